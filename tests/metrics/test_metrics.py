"""Behaviour of clew.metrics: collector reductions, loggers, history files, reports, catalog."""

import importlib.util
import json
import math
import time

import numpy as np
import pytest
import torch

from clew.errors import ClewError, ConfigError, DataError
from clew.metrics import (
    CATALOG,
    MetricsCollector,
    catalog_markdown,
    describe,
    draw_report,
    make_loggers,
    read_history,
    summarize,
    truncate_history,
)
from clew.metrics.history import history_path


def _log_steps(run_dir, steps, names="") -> None:
    with make_loggers(names, run_dir, "proj", "run") as loggers:
        for step, metrics in steps:
            loggers.log(metrics, step)


# --- collector ---------------------------------------------------------------------------


def test_collector_reduces_lists_to_mean_and_optional_extremes():
    c = MetricsCollector()
    c.extend("train/reward_mean", [0.0, 1.0])
    c.extend("train/reward_mean", torch.tensor([0.5, 0.5]), extremes=True)
    c.extend("train/turns_mean", np.array([2, 4]))
    out = c.flush(step=1)
    assert out["train/reward_mean"] == pytest.approx(0.5)
    assert out["train/reward_min"] == 0.0
    assert out["train/reward_max"] == 1.0
    assert out["train/turns_mean"] == 3.0
    assert "train/turns_min" not in out


def test_collector_accepts_tensor_and_numpy_scalars_and_averages_repeats():
    c = MetricsCollector()
    c.add("policy/loss", torch.tensor(1.0))
    c.add("policy/loss", np.float32(3.0))
    c.add_many({"policy/lr": 1e-5})
    c.add_many({"train/env_errors": 2}, reduce="sum")
    c.add("train/env_errors", 1, reduce="sum")
    out = c.flush(0)
    assert out["policy/loss"] == 2.0
    assert out["policy/lr"] == 1e-5
    assert out["train/env_errors"] == 3.0
    assert all(isinstance(v, float) for v in out.values())


def test_collector_rejects_arrays_passed_as_scalars():
    with pytest.raises(TypeError, match="extend"):
        MetricsCollector().add("x", torch.ones(3))


def test_timer_records_wall_seconds_even_when_the_block_raises():
    c = MetricsCollector()
    with c.timer("generate"):
        time.sleep(0.01)
    with pytest.raises(RuntimeError), c.timer("generate"):
        time.sleep(0.01)
        raise RuntimeError
    out = c.flush(0)
    assert 0.02 <= out["timing/generate"] < 1.0


def test_flush_resets_the_collector():
    c = MetricsCollector()
    c.add("policy/loss", 1.0)
    c.extend("train/reward_mean", [1.0])
    assert c.flush(0)["policy/loss"] == 1.0
    assert c.flush(1) == {}
    c.add("policy/loss", 5.0)
    assert c.flush(2) == {"metrics/non_finite": 0.0, "policy/loss": 5.0}


def test_non_finite_values_are_kept_and_counted(caplog):
    c = MetricsCollector()
    c.add("policy/loss", float("nan"))
    c.add("policy/grad_norm", torch.tensor(float("inf")))
    c.extend("train/reward_mean", [1.0, float("nan")], extremes=True)
    out = c.flush(7)
    assert math.isnan(out["policy/loss"])
    assert out["policy/grad_norm"] == math.inf
    assert math.isnan(out["train/reward_mean"]) and math.isnan(out["train/reward_max"])
    assert out["metrics/non_finite"] == 3.0
    assert "policy/loss" in caplog.text


# --- jsonl logger and history --------------------------------------------------------------


def test_jsonl_logger_writes_lines_that_read_history_returns(tmp_path):
    _log_steps(tmp_path, [(1, {"train/reward_mean": 0.25}), (2, {"train/reward_mean": 0.5})])
    assert read_history(tmp_path) == [
        {"step": 1, "train/reward_mean": 0.25},
        {"step": 2, "train/reward_mean": 0.5},
    ]


def test_jsonl_is_written_even_when_only_console_is_chosen(tmp_path):
    loggers = make_loggers(["console"], tmp_path, "proj", "run")
    assert loggers.names == ["jsonl", "console"]
    loggers.log({"policy/loss": 1.0}, 3)
    loggers.close()
    assert read_history(tmp_path) == [{"step": 3, "policy/loss": 1.0}]


def test_read_history_tolerates_a_truncated_last_line(tmp_path):
    _log_steps(tmp_path, [(1, {"a": 1.0}), (2, {"a": 2.0})])
    with history_path(tmp_path).open("a") as f:
        f.write('{"step": 3, "a": 3.')
    assert [r["step"] for r in read_history(tmp_path)] == [1, 2]
    # Appending after the crash must not glue a record onto the fragment.
    _log_steps(tmp_path, [(3, {"a": 3.0})])
    assert [r["step"] for r in read_history(tmp_path)] == [1, 2, 3]


def test_read_history_rejects_a_corrupt_middle_line(tmp_path):
    history_path(tmp_path).write_text('{"step": 1}\ngarbage\n{"step": 2}\n')
    with pytest.raises(DataError, match="line 2"):
        read_history(tmp_path)


def test_truncate_history_drops_later_steps_so_a_resume_has_no_duplicates(tmp_path):
    _log_steps(tmp_path, [(s, {"a": float(s)}) for s in range(1, 6)])
    assert truncate_history(tmp_path, 3) == 2
    _log_steps(tmp_path, [(4, {"a": 40.0})])
    assert [(r["step"], r["a"]) for r in read_history(tmp_path)] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
    assert truncate_history(tmp_path / "missing", 0) == 0


# --- other loggers --------------------------------------------------------------------------


def test_tensorboard_logger_writes_scalars_event_accumulator_reads(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_steps(tmp_path, [(5, {"train/reward_mean": 0.75})], names="tensorboard")
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    (event,) = acc.Scalars("train/reward_mean")
    assert event.step == 5
    assert event.value == pytest.approx(0.75)


def test_unknown_logger_name_error_lists_accepted_names(tmp_path):
    with pytest.raises(ConfigError) as err:
        make_loggers("console,tensorbored", tmp_path, "proj", "run")
    message = str(err.value)
    assert "tensorbored" in message
    for name in ("console", "jsonl", "tensorboard", "wandb", "mlflow"):
        assert name in message


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb installed")
def test_wandb_without_the_package_says_how_to_install_it(tmp_path):
    with pytest.raises(ConfigError, match="pip install wandb"):
        make_loggers(["wandb"], tmp_path, "proj", "run")


# --- report ----------------------------------------------------------------------------------


def _fake_run(run_dir) -> None:
    steps = []
    for s in range(1, 11):
        m = {"train/reward_mean": s / 10, "train/solve_rate": s / 20, "timing/step": 30.0}
        if s % 5 == 0:
            m["eval/all/pass_at_1"] = s / 12
        steps.append((s, m))
    _log_steps(run_dir, steps)


def test_draw_report_writes_a_png(tmp_path):
    from PIL import Image

    run_dir = tmp_path / "my-run"
    _fake_run(run_dir)
    out = draw_report(run_dir)
    assert out == run_dir / "report.png"
    with Image.open(out) as img:
        assert img.format == "PNG"
        # A panel by step and one by wall-clock minutes, each 6 x 4.5 inches at 100 dpi.
        assert img.size == (1200, 450)


def test_draw_report_on_a_run_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(ClewError, match="no metrics"):
        draw_report(tmp_path)
    with pytest.raises(ClewError, match="does not exist"):
        draw_report(tmp_path / "typo")


def test_summarize_reports_first_last_and_best_eval(tmp_path):
    _fake_run(tmp_path)
    summary = summarize(tmp_path)
    assert summary["steps"] == 10
    assert summary["first_pass_at_1"] == pytest.approx(5 / 12)
    assert summary["last_pass_at_1"] == pytest.approx(10 / 12)
    assert summary["best_step"] == 10
    assert summary["wall_minutes"] == pytest.approx(5.0)


# --- catalog ----------------------------------------------------------------------------------


def test_describe_knows_exact_templated_and_extreme_names():
    assert "solved" in describe("train/solve_rate")
    assert "update" in describe("timing/update")
    assert "max_turns" in describe("train/end_reason/max_turns")
    assert "wall" in describe("train/event/wall") and describe("eval/all/event/moved")
    assert describe("train/reward_max").startswith("Largest")
    assert describe("eval/all/pass_at_1")
    assert describe("no/such_metric") is None


def test_catalog_markdown_lists_every_metric():
    text = catalog_markdown()
    for spec in CATALOG:
        assert f"`{spec.name}`" in text


def test_metrics_logged_to_jsonl_survive_json_round_trip_with_nan(tmp_path):
    _log_steps(tmp_path, [(1, {"policy/loss": float("nan")})])
    line = history_path(tmp_path).read_text()
    assert math.isnan(json.loads(line)["policy/loss"])


def test_jsonl_logger_keeps_writing_after_the_history_is_truncated(tmp_path):
    from clew.metrics import make_loggers, read_history, truncate_history

    loggers = make_loggers("jsonl", tmp_path, "p", "r")
    for step in (1, 2, 3):
        loggers.log({"x": float(step)}, step)
    truncate_history(tmp_path, 1)  # as a resume from step 1 does, after the loggers opened
    loggers.log({"x": 2.5}, 2)
    loggers.close()
    assert [r["step"] for r in read_history(tmp_path)] == [1, 2]
