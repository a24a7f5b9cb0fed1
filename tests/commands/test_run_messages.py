"""What a run says and where it stops, without a model or Ray: each export prints where it
went, a phase whose every episode failed with an env error stops the run, the pipeline's
summary gives each evaluation's step, and transformers' progress bars stay off a log file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from clew.checkpoint.state import Checkpointer
from clew.config import load_config
from clew.data.rows import generate_rows, write_rows
from clew.errors import EnvError
from clew.metrics.progress import library_bars_unless_tty
from clew.rollout.trajectory import Trajectory
from clew.trainer.grpo import GRPOTrainer
from clew.trainer.pipeline import report


class _Group:
    """A worker group without a model: every episode of a row earns reward 1 on its first
    sample, or every one fails as ``env_error`` (``failing``); exports write one file."""

    world_size = 1

    def __init__(self, failing: bool = False) -> None:
        self.failing, self.updates = failing, 0

    def generate(self, rows, settings, seed, progress=None):
        out = []
        for g, row in enumerate(rows):
            for s in range(settings.n_samples_per_prompt):
                t = Trajectory(row.env_id, {}, int(row.seed), g, s)
                if self.failing:
                    t.end_reason, t.error = "env_error", "ConnectionError: the simulator is down"
                else:
                    t.reward, t.end_reason = float(s == 0), "stop"
                out.append(t)
        return out

    def update(self, batch, settings):
        self.updates += 1
        return {"policy/optimizer_steps": 1.0, "policy/skipped_steps": 0.0}

    def export(self, path):
        Path(path, "weights.txt").write_text("policy\n")

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class _Loggers:
    def log(self, metrics, step):
        pass


def _trainer(tmp_path: Path, group: _Group, *overrides: str) -> GRPOTrainer:
    cfg = load_config(
        None,
        [
            "trainer.train_batch_size=2",
            "trainer.policy_mini_batch_size=1",
            "generator.n_samples_per_prompt=2",
            "trainer.eval_before_train=false",
            "trainer.ckpt_interval=-1",
            "trainer.max_steps=2",
            *overrides,
        ],
    )
    rows = generate_rows("maze_2d/small", 8, "train")
    checkpointer = Checkpointer(cfg, tmp_path)
    return GRPOTrainer(cfg, group, rows, [], _Loggers(), tmp_path, checkpointer)


def test_grpo_prints_where_each_export_went(tmp_path, capsys):
    _trainer(tmp_path, _Group(), "trainer.hf_save_interval=1").fit()
    out = capsys.readouterr().out
    for step in (1, 2):  # step 2's once: the run's final export is that one
        dest = tmp_path / "exports" / f"global_step_{step}" / "policy"
        assert out.count(f"exported the policy of step {step} to {dest}\n") == 1
        assert (dest / "weights.txt").is_file()


def test_a_step_whose_every_episode_failed_with_an_env_error_stops_before_the_update(
    tmp_path, capsys
):
    group = _Group(failing=True)
    with pytest.raises(EnvError) as err:
        _trainer(tmp_path, group).fit()
    message = str(err.value)
    assert "every one of the 4 episodes of step 1 generate failed with an env error" in message
    assert "(4 of them): ConnectionError: the simulator is down" in message
    assert "'maze_2d/small'" in message
    assert group.updates == 0 and not (tmp_path / "exports").exists()


def _summary_run(tmp_path: Path, evals: dict[int, float], last_step: int) -> str:
    """``report``'s console line for a GRPO history with ``evals`` (step -> pass@1) that
    reached ``last_step``."""
    out = tmp_path / "pipeline"
    run = out / "grpo"
    run.mkdir(parents=True)
    lines = [{"step": s, "train/reward": 0.1} for s in range(1, last_step + 1)]
    history = sorted(
        [*lines, *({"step": s, "eval/all/pass_at_1": v} for s, v in evals.items())],
        key=lambda h: h["step"],
    )
    (run / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    write_rows(generate_rows("maze_2d/small", 4, "eval"), tmp_path / "eval.parquet")
    cfg = load_config(
        None,
        [
            f"trainer.log_path={out}",
            "trainer.run_name=grpo",
            f"data.val_data=['{tmp_path / 'eval.parquet'}']",
        ],
    )
    report(cfg, out)
    return json.loads((out / "summary.json").read_text())


def test_the_pipeline_summary_gives_the_step_of_each_evaluation(tmp_path, capsys):
    _summary_run(tmp_path / "a", {0: 0.25, 10: 0.5}, 10)
    line = capsys.readouterr().out
    assert "SFT start 25.0% (step 0), after GRPO 50.0% (step 10, +25.0 points)" in line
    # Stopped at step 3, before its next evaluation: only step 0's exists.
    summary = _summary_run(tmp_path / "b", {0: 0.25}, 3)
    line = capsys.readouterr().out
    assert "SFT start 25.0% (step 0); GRPO reached step 3 with no evaluation after" in line
    assert "after GRPO 25.0%" not in line
    assert summary["final_pass_at_1"] == summary["sft_pass_at_1"] == 0.25


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_transformers_progress_bars_are_drawn_only_on_a_terminal():
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()  # a worker built in this process turns them off
    hf_logging.enable_progress_bar()
    try:
        with library_bars_unless_tty(io.StringIO()):  # a log file, a pipe, `ray job logs`
            assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.is_progress_bar_enabled()
        with library_bars_unless_tty(_Terminal()):
            assert hf_logging.is_progress_bar_enabled()
    finally:
        if not was_on:
            hf_logging.disable_progress_bar()
