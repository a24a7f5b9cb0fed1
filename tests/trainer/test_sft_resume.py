"""`clew sft`: one config (a YAML file, aliases and dotted overrides), bad input refused
before any work, kill -9 and resume ending on the same weights, another run's checkpoint
refused."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from clew.cli import main
from clew.data.rows import generate_rows, write_rows
from clew.metrics import read_history
from clew.models import load_policy

OPTIONS = {"cell_px": 28, "action_format": "keyword"}
STEPS = 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    write_rows(generate_rows("maze_2d/tiny", 8, env_options=OPTIONS), path)
    return path


def test_sft_command_runs_from_a_yaml_file_with_aliases_and_overrides(model_dir, data, tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "data": {"train_data": [str(data)]},
                "trainer": {"log_path": str(tmp_path / "runs"), "logger": ["console"]},
                "sft": {
                    "model_path": str(model_dir),
                    "run_name": "warmup",
                    "steps": 6,
                    "batch_size": 2,
                    "ckpt_interval": 2,
                },
            }
        )  # fmt: skip
    )
    # The --steps alias applies before the positional overrides: sft.steps=3 wins.
    code = main(["sft", "--config", str(config), "--steps", "4", "sft.steps=3",
                 "sft.optimizer_config.lr=2e-3"])  # fmt: skip
    assert code == 0
    run = tmp_path / "runs" / "warmup"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["sft"]["steps"] == 3 and saved["sft"]["optimizer_config"]["lr"] == 2e-3
    assert saved["sft"]["batch_size"] == 2 and saved["data"]["train_data"] == [str(data)]
    assert [r["step"] for r in read_history(run)] == [1, 2, 3]
    assert sorted(p.name for p in (run / "ckpts").glob("global_step_*")) == [
        "global_step_2",
        "global_step_3",
    ]
    load_policy(run / "exports" / "final" / "policy")


def _launch(model_dir: Path, data: Path, root: Path, run: str, *extra: str) -> subprocess.Popen:
    args = [
        "sft", "--model", str(model_dir), "--data", str(data), "--steps", str(STEPS),
        "--batch-size", "2", f"trainer.log_path={root}", f"sft.run_name={run}",
        "trainer.logger=jsonl", "sft.ckpt_interval=4", "sft.detour_prob=0.3",
        "sft.dagger.interval=2", "sft.dagger.rows=2", "sft.dagger.keep_rounds=0", *extra,
    ]  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "clew", *args],
        # One thread: the tiny model gains nothing from more, and both runs must use the same.
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["sft/loss"] for r in read_history(run)}


def test_kill_during_sft_and_resume_ends_on_the_weights_of_an_undisturbed_run(
    model_dir, data, tmp_path
):
    root = tmp_path / "runs"
    straight = _launch(model_dir, data, root, "straight")
    out, _ = straight.communicate(timeout=600)
    assert straight.returncode == 0, out
    history = {r["step"]: r for r in read_history(root / "straight")}
    # The checkpoint of step 4 holds a DAgger pool (the round after step 2) to restore.
    assert history[3]["sft/dagger_pool"] > 0

    victim = _launch(model_dir, data, root, "killed")
    pointer = root / "killed" / "ckpts" / "latest_ckpt_global_step.txt"
    deadline = time.time() + 300
    while not pointer.exists():
        assert victim.poll() is None, victim.stdout.read()
        assert time.time() < deadline
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (root / "killed" / "exports" / "final").exists()

    resumed = _launch(model_dir, data, root, "killed", "trainer.resume_mode=latest")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert "at global step 4" in out  # the first checkpoint: steps 5 and 6 run again
    a = load_file(root / "straight" / "exports" / "final" / "policy" / "model.safetensors")
    b = load_file(root / "killed" / "exports" / "final" / "policy" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert _losses(root / "straight") == _losses(root / "killed")


@pytest.mark.parametrize(
    ("text", "override", "messages"),
    [
        (None, "", ["nope.yaml", "does not exist"]),
        ("sft: [1, 2\n", "", ["c.yaml", "is not valid YAML: line 2"]),
        ("sft:\n  stesp: 3\n", "", ["c.yaml", "unknown config key 'sft.stesp'", "'sft.steps'"]),
        ("sft:\n  steps: many\n", "", ["c.yaml", "sft.steps: expected int, got 'many'"]),
        ("", "sft.dagger.intervall=3", ["did you mean 'sft.dagger.interval'"]),
        ("", "sft.dagger.share=2", ["sft.dagger.share is a share of each batch in (0, 1]"]),
    ],
)
def test_bad_config_input_is_one_clear_error_before_any_work(
    model_dir, data, tmp_path, capsys, text, override, messages
):
    config = tmp_path / ("nope.yaml" if text is None else "c.yaml")
    if text is not None:
        config.write_text(text)
    args = ["sft", "--config", str(config), "--model", str(model_dir), "--data", str(data),
            f"trainer.log_path={tmp_path / 'runs'}", *([override] if override else [])]  # fmt: skip
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("clew sft: error: ") and err.count("\n") == 1, err
    assert all(m in err for m in messages), err
    assert not (tmp_path / "runs").exists()


def test_resume_on_a_folder_holding_another_runs_checkpoint_refuses_with_what_differs(
    model_dir, data, tmp_path, capsys
):
    runs = tmp_path / "runs"
    first = ["sft", "--model", str(model_dir), "--data", str(data), "--steps", "2",
             f"trainer.log_path={runs}", "trainer.logger=jsonl"]  # fmt: skip
    assert main(first) == 0
    config_before = (runs / "sft" / "config.yaml").read_text()
    other_model = shutil.copytree(model_dir, tmp_path / "other_model")
    other_data = shutil.copy(data, tmp_path / "other.parquet")
    code = main(["sft", "--model", str(other_model), "--data", str(other_data), "--steps", "2",
                 f"trainer.log_path={runs}", "sft.lora.rank=4",
                 "trainer.resume_mode=latest"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert "does not fit this run" in err
    assert f"sft.model_path: checkpoint {str(model_dir)!r}, this run {str(other_model)!r}" in err
    assert f"data.train_data: checkpoint [{str(data)!r}], this run [{str(other_data)!r}]" in err
    assert "sft.lora.rank: checkpoint 0, this run 4" in err
    assert "Traceback" not in err
    # Nothing of the first run was touched.
    assert (runs / "sft" / "config.yaml").read_text() == config_before
    assert [r["step"] for r in read_history(runs / "sft")] == [1, 2]
