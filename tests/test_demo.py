"""Tests for `clew pipeline` (clew.trainer.pipeline) on the CPU main job's recipe, made tiny."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from clew.cli import main
from clew.config import load_config
from clew.errors import ConfigError
from clew.trainer.pipeline import check_stages

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cpu-demo.yaml"
# The recipe at a size that runs in seconds: 16 train rows, 4 eval rows, 2 SFT steps,
# 2 GRPO steps of 2 prompts x 2 samples, evaluated before the first step and after each.
TINY = [
    "pipeline.dataset.train_rows=16",
    "pipeline.dataset.eval_rows=4",
    "sft.steps=2",
    "sft.batch_size=4",
    "trainer.max_steps=2",
    "trainer.train_batch_size=2",
    "trainer.policy_mini_batch_size=2",
    "generator.n_samples_per_prompt=2",
    "trainer.micro_train_batch_size_per_gpu=4",
    "trainer.micro_forward_batch_size_per_gpu=4",
    "trainer.eval_interval=1",
    "trainer.ckpt_interval=2",
    "trainer.hf_save_interval=2",
]


def _pipeline(out: Path) -> int:
    return main(["pipeline", "--config", str(RECIPE), "--output-dir", str(out), *TINY])


def _config(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


@pytest.fixture(scope="module")
def finished(tmp_path_factory, one_thread) -> Path:
    out = tmp_path_factory.mktemp("demo")
    assert _pipeline(out) == 0
    return out


def test_pipeline_runs_sft_then_grpo_and_reports_both_eval_figures(finished: Path) -> None:
    summary = json.loads((finished / "summary.json").read_text())
    assert set(summary) == {
        "sft_pass_at_1",
        "final_pass_at_1",
        "gain_points",
        "best_pass_at_1",
        "best_step",
    }
    run_dir = finished / "grpo"
    history = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {h["step"]: h["eval/all/pass_at_1"] for h in history if "eval/all/pass_at_1" in h}
    assert list(evals) == [0, 1, 2]
    # The start's figure is GRPO's evaluation before its first step; the final one its last.
    assert summary["sft_pass_at_1"] == history[0]["eval/all/pass_at_1"] == evals[0]
    assert summary["final_pass_at_1"] == evals[2]
    assert summary["best_pass_at_1"] == max(evals.values()) == evals[summary["best_step"]]
    assert summary["best_pass_at_1"] >= max(summary["sft_pass_at_1"], summary["final_pass_at_1"])
    assert summary["gain_points"] == pytest.approx(
        100 * (summary["final_pass_at_1"] - summary["sft_pass_at_1"])
    )
    best = json.loads((run_dir / "exports" / "best" / "best.json").read_text())
    assert best["step"] == summary["best_step"]
    assert (run_dir / "report.png").stat().st_size > 0


def test_each_stage_runs_with_the_recipe_and_what_the_stage_before_made(finished: Path) -> None:
    sft, grpo = _config(finished / "sft"), _config(finished / "grpo")
    train, val = str(finished / "data" / "train.parquet"), str(finished / "data" / "eval.parquet")
    for cfg in (sft, grpo):
        assert cfg["data"] == {"train_data": [train], "val_data": [val]}
        assert cfg["generator"]["keep_last_k_images"] == 1
    assert sft["sft"]["model_path"] == str(finished / "models" / "base")
    assert sft["sft"]["optimizer_config"]["num_warmup_steps"] == 10
    final = finished / "sft" / "exports" / "final" / "policy"
    assert grpo["trainer"]["policy"]["model"]["path"] == str(final)
    assert (final / "config.json").is_file()
    # The recipe's own GRPO settings reach the run: schedule, temperature, loss reduction.
    assert grpo["trainer"]["policy"]["optimizer_config"]["scheduler"] == "cosine"
    assert grpo["generator"]["sampling_params"]["temperature"] == 0.7
    assert grpo["trainer"]["algorithm"]["loss_reduction"] == "sequence_mean"
    assert grpo["trainer"]["policy_mini_batch_size"] == 2
    built = json.loads((finished / "models" / "base" / "clew_build.json").read_text())
    assert (built["preset"], built["image_size"], built["patch_size"]) == ("tiny", 98, 14)


def test_rerunning_a_finished_pipeline_skips_its_stages(finished: Path, capsys) -> None:
    base = finished / "models" / "base" / "model.safetensors"
    before = (base.stat().st_mtime_ns, (finished / "grpo" / "metrics.jsonl").read_text())
    summary = (finished / "summary.json").read_text()
    capsys.readouterr()
    assert _pipeline(finished) == 0
    said = capsys.readouterr().out
    for stage in ("dataset", "model", "sft"):
        assert any(
            line.startswith("[pipeline") and f"] {stage}:" in line and "skipped" in line
            for line in said.splitlines()
        ), said
    assert "resumed from" in said  # GRPO goes on from its last checkpoint: nothing to do
    assert (base.stat().st_mtime_ns, (finished / "grpo" / "metrics.jsonl").read_text()) == before
    assert (finished / "summary.json").read_text() == summary


def test_output_of_other_settings_is_refused_naming_what_differs(finished: Path, capsys) -> None:
    args = ["pipeline", "--config", str(RECIPE), "--output-dir", str(finished), *TINY]
    assert main([*args, "pipeline.dataset.eval_rows=5", "pipeline.stages=[dataset]"]) == 2
    err = capsys.readouterr().err
    assert "pipeline.dataset.eval_rows: 4 there, 5 now" in err
    assert str(finished / "data") in err


def test_a_stage_made_from_a_rebuilt_input_is_refused_not_reused(
    finished: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    shutil.rmtree(out / "models" / "base")
    args = ["pipeline", "--config", str(RECIPE), "--output-dir", str(out), *TINY]
    assert main([*args, "pipeline.model.seed=1", "pipeline.stages=[dataset,model,sft]"]) == 2
    err = capsys.readouterr().err
    assert "stages.model" in err and str(out / "sft") in err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["pipeline.stages=[train,sft]"], "in the order dataset, model, sft, train"),
        (["pipeline.stages=[sft,sft]"], "at most once"),
        (["pipeline.stages=[sft,train]"], "needs sft.model_path"),
        (["pipeline.stages=[train]"], "needs trainer.policy.model.path"),
        (["pipeline.stages=[model,sft]"], "need data.train_data"),
        (["sft.run_name=grpo"], "both 'grpo'"),
        (["trainer.run_name=data"], "share its folder"),
    ],
)
def test_a_chain_that_cannot_run_is_refused_before_any_stage(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_stages(load_config(RECIPE, overrides))
