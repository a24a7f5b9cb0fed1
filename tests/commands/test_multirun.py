"""``clew train -m``: the sweep's grid (Hydra's multirun grammar), every combination checked
before any run, a failed or stopped run recorded, and a real sweep of two tiny CPU runs that
a second command skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.tiny import DIGITS_GRPO_SHAPE, digits_data, digits_policy

from clew.cli import main
from clew.config.sweep import parse_grid, short_keys, value_slugs
from clew.errors import ConfigError
from clew.trainer import launch
from clew.trainer.stopping import GracefulStop
from clew.trainer.sweep import FINISHED_FILE, SUMMARY_FILE

LR = "trainer.policy.optimizer_config.lr"
RANK = "trainer.policy.model.lora.rank"

# -- the grid -------------------------------------------------------------------------------


def test_commas_at_top_level_are_an_axis_brackets_and_quotes_one_value():
    grid = parse_grid([f"{LR}=1e-4, 2e-4", "data.train_data=[a.parquet,b.parquet]",
                       "trainer.project_name='x,y'", 'trainer.run_name="p,q"'])  # fmt: skip
    assert [(a.key, a.values) for a in grid.axes] == [(LR, ("1e-4", "2e-4"))]
    assert grid.fixed == (
        "data.train_data=[a.parquet,b.parquet]",
        "trainer.project_name='x,y'",
        'trainer.run_name="p,q"',
    )
    lists = parse_grid(["data.val_data=[a],[b,c]", "generator.max_turns='3',4"]).axes
    assert [a.values for a in lists] == [("[a]", "[b,c]"), ("'3'", "4")]


def test_no_axes_is_one_run_of_the_overrides_as_given():
    grid = parse_grid(["trainer.max_steps=1", "trainer.project_name=a"])
    assert grid.axes == ()
    (only,) = grid.combinations()
    assert only.name == "run"
    assert only.overrides == ("trainer.max_steps=1", "trainer.project_name=a")
    assert parse_grid([]).combinations()[0].overrides == ()


def test_one_axis_gives_a_run_per_value_after_the_fixed_overrides():
    runs = parse_grid([f"{LR}=1e-4,2e-4,3e-4", "trainer.max_steps=1"]).combinations()
    assert [r.name for r in runs] == ["lr=1e-4", "lr=2e-4", "lr=3e-4"]
    assert runs[1].overrides == ("trainer.max_steps=1", f"{LR}=2e-4")
    assert runs[1].values == {LR: "2e-4"}


def test_two_axes_are_the_product_the_last_axis_varying_fastest():
    runs = parse_grid([f"{LR}=1e-4,2e-4", f"{RANK}=32,64"]).combinations()
    assert [r.name for r in runs] == [
        "lr=1e-4,rank=32",
        "lr=1e-4,rank=64",
        "lr=2e-4,rank=32",
        "lr=2e-4,rank=64",
    ]
    assert runs[2].overrides == (f"{LR}=2e-4", f"{RANK}=32")


def test_names_are_short_safe_and_distinct():
    assert short_keys([LR, "sft.optimizer_config.lr", RANK]) == [
        "policy.optimizer_config.lr",
        "sft.optimizer_config.lr",
        "rank",
    ]
    slugs = value_slugs(("/m/a/policy", "[a.parquet,b.parquet]", "'x y'"))
    assert slugs == ["m_a_policy", "a.parquet_b.parquet", "x_y"]
    apart = value_slugs(("a/b", "a_b"))
    assert len(set(apart)) == 2 and all(s.startswith("a_b") for s in apart)
    # An alias is spelt as its key; a '+' (Hydra's "add") is dropped.
    (axis,) = parse_grid(["+trainer.algorithm.grpo_norm_by_std=true,false"]).axes
    assert axis.key == "trainer.algorithm.norm_adv_by_std_in_grpo"


@pytest.mark.parametrize(
    "overrides, says",
    [
        ([f"{LR}=1e-4,,2e-4"], "empty value"),
        ([f"{LR}=1e-4,1e-4"], "more than once"),
        ([f"{LR}=1e-4,2e-4", f"{LR}=3e-4"], "given 2 times"),
        (["trainer.run_name=a,b"], "cannot be swept"),
        (["trainer.log_path=a,b"], "cannot be swept"),
    ],
)
def test_a_grid_that_cannot_be_run_is_refused(overrides, says):
    with pytest.raises(ConfigError, match=says):
        parse_grid(overrides)


# -- the command, with run_grpo replaced --------------------------------------------------


def _fixed(tmp_path: Path) -> list[str]:
    """Overrides a sweep needs to pass its checks, for a faked run_grpo (nothing is read)."""
    return [
        f"trainer.log_path={tmp_path / 'runs'}",
        "trainer.run_name=sweep",
        "trainer.policy.model.path=/no/model",
        "data.train_data=[/no/train.parquet]",
    ]


def _summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "runs" / "sweep" / SUMMARY_FILE).read_text())


def test_a_bad_value_in_any_combination_fails_before_the_first_run(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(launch, "run_grpo", lambda cfg: ran.append(cfg) or {})
    argv = ["train", "-m", *_fixed(tmp_path), f"{LR}=1e-4,2e-4", f"{RANK}=8,lots"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "sweep run 2 of 4 (lr=1e-4,rank=lots)" in err
    assert "trainer.policy.model.lora.rank" in err
    assert ran == [] and not (tmp_path / "runs").exists()
    # What run_grpo itself would refuse before loading anything is refused too.
    argv = ["train", "-m", f"trainer.log_path={tmp_path / 'runs'}", f"{LR}=1e-4,2e-4"]
    assert main(argv) == 2
    assert "sweep run 1 of 2 (lr=1e-4): data.train_data is empty" in capsys.readouterr().err
    assert ran == []


def test_without_m_a_comma_value_is_one_value_as_before(capsys):
    assert main(["train", "--print-config", f"{LR}=1e-4,2e-4"]) == 2
    assert "got '1e-4,2e-4'" in capsys.readouterr().err
    assert main(["train", "--print-config", "trainer.project_name=a,b"]) == 0
    assert "project_name: a,b" in capsys.readouterr().out


def test_print_config_prints_each_combination(tmp_path, capsys):
    argv = ["train", "-m", "--print-config", *_fixed(tmp_path), f"{RANK}=8,16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "# sweep run 2 of 2: rank=16" in out
    assert "run_name: sweep/rank=8" in out and "run_name: sweep/rank=16" in out
    assert not (tmp_path / "runs").exists()


def test_a_failed_run_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    def run_grpo(cfg):
        if cfg.trainer.policy.model.lora.rank == 8:
            raise RuntimeError("out of memory\nmore detail")
        return {}

    monkeypatch.setattr(launch, "run_grpo", run_grpo)
    argv = ["train", "-m", *_fixed(tmp_path), f"{RANK}=8,16"]
    assert main(argv) == 1
    rows = _summary(tmp_path)["runs"]
    assert [(r["name"], r["status"], r["error"]) for r in rows] == [
        ("rank=8", "failed", "RuntimeError: out of memory"),
        ("rank=16", "finished", None),
    ]
    assert "rank=8   failed" in capsys.readouterr().out
    # Again: the finished run is skipped, the failed one tried again.
    tried = []
    monkeypatch.setattr(launch, "run_grpo", lambda cfg: tried.append(cfg.trainer.run_name) or {})
    assert main(argv) == 0
    assert tried == ["sweep/rank=8"]


def test_a_stopped_run_ends_the_sweep_and_is_not_finished(tmp_path, monkeypatch, capsys):
    def stopped(cfg):
        GracefulStop.stops += 1  # what a SIGINT during the run's loop does
        return {}

    monkeypatch.setattr(launch, "run_grpo", stopped)
    argv = ["train", "-m", *_fixed(tmp_path), f"{RANK}=8,16"]
    assert main(argv) == 130
    rows = _summary(tmp_path)["runs"]
    assert [r["status"] for r in rows] == ["stopped", "pending"]
    assert not (tmp_path / "runs" / "sweep" / "rank=8" / FINISHED_FILE).exists()


# -- a real sweep --------------------------------------------------------------------------


def test_a_sweep_of_two_tiny_runs_then_the_same_command_skips_both(
    tmp_path, one_thread, monkeypatch, capsys
):
    argv = [
        "train",
        "-m",
        f"data.train_data=['{digits_data(8)}']",
        f"data.val_data=['{digits_data(4, 'eval')}']",
        f"trainer.policy.model.path={digits_policy()}",
        f"trainer.log_path={tmp_path / 'runs'}",
        "trainer.run_name=sweep",
        "trainer.logger=jsonl",
        "trainer.max_steps=1",
        *DIGITS_GRPO_SHAPE,
        f"{LR}=1e-3,3e-3",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    sweep = tmp_path / "runs" / "sweep"
    for name, lr in (("lr=1e-3", 1e-3), ("lr=3e-3", 3e-3)):
        run = sweep / name
        assert f"run_name: sweep/{name}" in (run / "config.yaml").read_text()
        assert f"lr: {lr}" in (run / "config.yaml").read_text()
        assert (run / "metrics.jsonl").is_file() and (run / FINISHED_FILE).is_file()
        assert (run / "exports").is_dir()
    summary = _summary(tmp_path)
    assert summary["metric"] == "eval/all/pass_at_1"
    assert summary["axes"] == {LR: ["1e-3", "3e-3"]}
    rows = summary["runs"]
    assert [(r["name"], r["status"], r["skipped"], r["steps"]) for r in rows] == [
        ("lr=1e-3", "finished", False, 1),
        ("lr=3e-3", "finished", False, 1),
    ]
    assert all(0.0 <= r["last_pass_at_1"] <= r["best_pass_at_1"] <= 1.0 for r in rows)
    assert rows[1]["overrides"] == {LR: "3e-3"}
    assert "last pass@1" in out and "lr=3e-3" in out

    def must_not_run(cfg):
        raise AssertionError(f"{cfg.trainer.run_name} ran again")

    monkeypatch.setattr(launch, "run_grpo", must_not_run)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("finished before; skipped") == 2
    again = _summary(tmp_path)["runs"]
    assert [(r["status"], r["skipped"]) for r in again] == [("finished", True)] * 2
    assert [r["last_pass_at_1"] for r in again] == [r["last_pass_at_1"] for r in rows]
