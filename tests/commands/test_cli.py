"""The ``clew`` command's own flags: ``--print-config`` on the commands that run (the
resolved configuration a run would save, printed without running; bad input fails as the
run would) and ``--version``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import clew
from clew.cli import main
from clew.config import load_config

RECIPE = str(Path(__file__).parents[2] / "recipes" / "cpu-demo.yaml")


def _printed(capsys, argv: list[str], tmp_path: Path):
    assert main(argv) == 0
    out = capsys.readouterr().out
    saved = tmp_path / "printed.yaml"
    saved.write_text(out)
    return out, load_config(saved)


def test_train_prints_the_config_it_would_run_and_runs_nothing(capsys, tmp_path):
    log = tmp_path / "runs"
    overrides = ["trainer.max_steps=3", f"trainer.log_path={log}"]
    out, printed = _printed(
        capsys, ["train", "--config", RECIPE, "--print-config", *overrides], tmp_path
    )
    assert out.startswith("# clew resolved configuration")
    assert printed == load_config(RECIPE, overrides)
    assert printed.trainer.max_steps == 3
    assert not log.exists()  # no run folder, no checkpoint, no model loaded


def test_sft_and_pipeline_print_their_flags_as_the_keys_they_stand_for(capsys, tmp_path):
    _, sft = _printed(
        capsys, ["sft", "--config", RECIPE, "--steps", "7", "--print-config"], tmp_path
    )
    assert sft.sft.steps == 7
    out_dir = str(tmp_path / "demo")
    argv = ["pipeline", "--config", RECIPE, "--output-dir", out_dir, "--print-config"]
    _, pipeline = _printed(capsys, argv, tmp_path)
    assert pipeline.trainer.log_path == out_dir
    assert not Path(out_dir).exists()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["train", "--print-config", "trainer.max_stesp=3"], "did you mean 'trainer.max_steps'"),
        (["pipeline", "--config", RECIPE, "--print-config", "pipeline.stages=[]"], "is empty"),
    ],
)
def test_a_bad_config_fails_as_the_run_would_instead_of_printing(capsys, argv, says):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert says in captured.err and captured.out == ""


def test_version_names_clew_and_what_a_bug_report_needs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"clew {clew.__version__} (python ")
    for package in ("torch", "transformers", "peft", "ray"):
        assert f"{package} " in out


def test_a_warning_of_clew_prints_as_one_line_naming_the_command(capsys):
    from clew.config.ignored import reset_ignored_warnings

    reset_ignored_warnings()  # warned once a process: forget it here
    argv = ["train", "--print-config", "generator.inference_engine.num_engines=6"]
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith(
        "clew train: warning: config key generator.inference_engine.num_engines=6"
    )
    assert "return validate(" not in err and ".py:" not in err
