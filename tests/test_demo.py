"""Tests for clew.demo: the main job's pipeline, on a plan small enough to run in seconds."""

from __future__ import annotations

import json
from pathlib import Path

from clew.demo import DemoPlan, run_demo


def test_demo_runs_sft_then_grpo_and_reports_both_eval_figures(tmp_path: Path) -> None:
    plan = DemoPlan(
        train_rows=16,
        eval_rows=4,
        sft_steps=2,
        sft_batch_size=4,
        grpo_steps=2,
        grpo_prompts=2,
        grpo_mini_batch=2,
        grpo_samples=2,
        extra_overrides=(
            "trainer.micro_train_batch_size_per_gpu=4",
            "trainer.micro_forward_batch_size_per_gpu=4",
        ),
    )
    summary = run_demo(tmp_path, plan)
    assert set(summary) == {
        "sft_pass_at_1",
        "final_pass_at_1",
        "gain_points",
        "best_pass_at_1",
        "best_step",
    }
    assert summary["best_pass_at_1"] >= max(summary["sft_pass_at_1"], summary["final_pass_at_1"])
    best = json.loads((tmp_path / "runs" / "grpo" / "exports" / "best" / "best.json").read_text())
    assert best["step"] == summary["best_step"]
    assert 0.0 <= summary["sft_pass_at_1"] <= 1.0 and 0.0 <= summary["final_pass_at_1"] <= 1.0
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    run_dir = tmp_path / "runs" / "grpo"
    config = (run_dir / "config.yaml").read_text()
    # The plan reaches the run: the image window, the mini-batch, the sampling temperature
    # and the learning-rate schedule.
    assert "keep_last_k_images: 1" in config
    assert "scheduler: cosine" in config
    assert "policy_mini_batch_size: 2" in config
    assert "temperature: 0.7" in config
    assert (run_dir / "report.png").stat().st_size > 0
    # eval_interval is a quarter of the steps (at least 1), with an eval before training.
    history = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history if "eval/all/pass_at_1" in h] == [0, 1, 2]
