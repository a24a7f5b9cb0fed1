"""Tests for `clew pipeline` (clew.trainer.pipeline) on the CPU main job's recipe, made tiny."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from support.tiny import TINY_GRPO

from clew.cli import main
from clew.config import load_config
from clew.data.rows import read_rows, task_keys
from clew.errors import ConfigError
from clew.trainer import pipeline
from clew.trainer.pipeline import check_stages

FIGURES = ("solve_rate", "reward_pass_at_1")
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cpu-demo.yaml"
# The recipe at a size that runs in seconds: 16 train rows, 4 eval rows, 2 SFT steps,
# 2 GRPO steps of 2 prompts x 2 samples, evaluated before the first step and after each,
# then the 'test' stage on 6 held-out rows.
TINY = [
    "pipeline.stages=[dataset,model,sft,train,test]",
    "pipeline.dataset.train_rows=16",
    "pipeline.dataset.eval_rows=4",
    "pipeline.test.rows=6",
    "sft.steps=2",
    "sft.batch_size=4",
    *TINY_GRPO,
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
    tested = json.loads((finished / "test.json").read_text())
    assert set(summary) == {
        "sft_pass_at_1",
        "final_pass_at_1",
        "gain_points",
        "best_pass_at_1",
        "best_step",
        "test_rows",
        *(f"test_{name}_{figure}" for name in tested for figure in FIGURES),
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
        # No selection set: pipeline.dataset.select_rows is 0 in the recipe.
        assert cfg["data"] == {"train_data": [train], "val_data": [val], "select_data": []}
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


def test_the_test_stage_draws_held_out_mazes_none_an_eval_maze(finished: Path) -> None:
    held_out = read_rows(finished / "data" / "test.parquet")
    evals = read_rows(finished / "data" / "eval.parquet")
    assert len(held_out) == 6 and {r.split for r in held_out} == {"eval"}
    keys = [r.facts()["layout_key"] for r in held_out]
    assert len(set(keys)) == 6
    assert set(keys).isdisjoint(task_keys(evals))
    assert {r.seed for r in held_out}.isdisjoint({r.seed for r in evals})
    assert min(r.seed for r in held_out) >= 2_000_000_000
    assert held_out[0].options() == evals[0].options()  # the eval set's distribution


def test_the_test_figures_are_of_the_sft_policy_and_grpos_last_export(finished: Path) -> None:
    summary = json.loads((finished / "summary.json").read_text())
    tested = json.loads((finished / "test.json").read_text())
    exports = finished / "grpo" / "exports"
    best = json.loads((exports / "best" / "best.json").read_text())["step"]
    assert list(tested) == ["start", "final"] + (["best"] if best not in (0, 2) else [])
    assert tested["start"]["policy"] == str(finished / "sft" / "exports" / "final" / "policy")
    assert tested["start"]["step"] == 0
    # The last export: GRPO's 2 steps end at global_step_2.
    assert tested["final"]["policy"] == str(exports / "global_step_2" / "policy")
    assert tested["final"]["step"] == 2
    assert summary["test_rows"] == 6
    for name, result in tested.items():
        metrics = json.loads((finished / "test" / name / "metrics.json").read_text())
        assert result["episodes"] == metrics["eval/all/episodes"] == 6
        for figure in FIGURES:
            assert summary[f"test_{name}_{figure}"] == result[figure]
            assert result[figure] == metrics[f"eval/all/{figure}"]
        assert (finished / "test" / name / "trajectories.jsonl").is_file()


def test_the_test_stage_runs_again_once_grpo_has_gone_further(
    finished: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    exports = out / "grpo" / "exports"
    shutil.copytree(exports / "global_step_2", exports / "global_step_3")  # a later export
    # GRPO itself is not run again: the export above stands for its further steps.
    monkeypatch.setitem(pipeline._STAGE_FNS, "train", lambda cfg, _: cfg)
    inputs = [
        "pipeline.stages=[train,test]",
        f"trainer.policy.model.path={out / 'sft' / 'exports' / 'final' / 'policy'}",
        f"data.train_data=[{out / 'data' / 'train.parquet'}]",
        f"data.val_data=[{out / 'data' / 'eval.parquet'}]",
    ]
    capsys.readouterr()
    assert (
        main(["pipeline", "--config", str(RECIPE), "--output-dir", str(out), *TINY, *inputs]) == 0
    )
    assert "test: start (step 0), final (step 3)" in capsys.readouterr().out
    tested = json.loads((out / "test.json").read_text())
    assert tested["final"]["policy"] == str(exports / "global_step_3" / "policy")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_final_solve_rate"] == tested["final"]["solve_rate"]


def test_rerunning_a_finished_pipeline_skips_its_stages(finished: Path, capsys) -> None:
    base = finished / "models" / "base" / "model.safetensors"
    before = (base.stat().st_mtime_ns, (finished / "grpo" / "metrics.jsonl").read_text())
    summary, tested = (finished / "summary.json").read_text(), (finished / "test.json").read_text()
    capsys.readouterr()
    assert _pipeline(finished) == 0
    said = capsys.readouterr().out
    for stage in ("dataset", "model", "sft", "test"):
        assert any(
            line.startswith("[pipeline") and f"] {stage}:" in line and "skipped" in line
            for line in said.splitlines()
        ), said
    assert "resumed from" in said  # GRPO goes on from its last checkpoint: nothing to do
    assert (base.stat().st_mtime_ns, (finished / "grpo" / "metrics.jsonl").read_text()) == before
    assert (finished / "summary.json").read_text() == summary
    assert (finished / "test.json").read_text() == tested


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
        (["pipeline.stages=[dataset,model,sft,test]"], "needs 'train' in pipeline.stages"),
        (["pipeline.test.rows=0"], "pipeline.test.rows must be >= 1"),
        (["sft.run_name=grpo"], "both 'grpo'"),
        (["trainer.run_name=data"], "share its folder"),
    ],
)
def test_a_chain_that_cannot_run_is_refused_before_any_stage(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_stages(load_config(RECIPE, overrides))
