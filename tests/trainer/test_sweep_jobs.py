"""``clew train -m --jobs N``: a sweep's runs side by side, each a child process of its own
(``clew.trainer.sweep_jobs``): real tiny CPU runs that finish and are then skipped, a run
that fails recorded while the other finishes, and a stopped sweep whose runs save first."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from support.tiny import DIGITS_GRPO_SHAPE, digits_data, digits_policy

from clew.cli import main
from clew.config import load_config
from clew.trainer import launch
from clew.trainer.sweep import FINISHED_FILE, SUMMARY_FILE
from clew.trainer.sweep_jobs import LOG_FILE, child_env, error_line, gpu_share, last_eval

LR = "trainer.policy.optimizer_config.lr"


TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def children_import_the_test_env(monkeypatch):
    """The runs' processes find ``envs_for_tests`` (environment.modules), as a user's
    processes find the module that registers their env."""
    paths = [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "train",
        "-m",
        "--jobs",
        "2",
        f"data.train_data=['{digits_data(8)}']",
        f"data.val_data=['{digits_data(4, 'eval')}']",
        f"trainer.log_path={tmp_path / 'runs'}",
        "trainer.run_name=sweep",
        "trainer.logger=jsonl",
        "environment.modules=[envs_for_tests]",
        *DIGITS_GRPO_SHAPE,
        *extra,
    ]


def _rows(tmp_path: Path) -> list[dict]:
    return json.loads((tmp_path / "runs" / "sweep" / SUMMARY_FILE).read_text())["runs"]


def test_two_runs_side_by_side_finish_in_their_own_processes_and_are_skipped_after(
    tmp_path, monkeypatch, capsys
):
    argv = _argv(
        tmp_path,
        f"trainer.policy.model.path={digits_policy()}",
        "trainer.max_steps=1",
        f"{LR}=1e-3,3e-3",
    )
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("(process ") == 2
    sweep = tmp_path / "runs" / "sweep"
    for name in ("lr=1e-3", "lr=3e-3"):
        run = sweep / name
        assert (run / "metrics.jsonl").is_file() and (run / "exports").is_dir()
        assert "eval" in (run / LOG_FILE).read_text()  # the run's own output
        # Each run's share of a GPU's memory: half, two side by side (device auto).
        assert "gpu_memory_fraction: 0.5" in (run / "config.yaml").read_text()
        record = json.loads((run / FINISHED_FILE).read_text())
        assert record["last_eval"] == last_eval(run) and "eval/all/pass_at_1" in record["last_eval"]
    rows = _rows(tmp_path)
    assert [(r["name"], r["status"], r["steps"]) for r in rows] == [
        ("lr=1e-3", "finished", 1),
        ("lr=3e-3", "finished", 1),
    ]

    # The children's saved configs are the ones the sweep planned: the same command skips both.
    def must_not_run(cfg):
        raise AssertionError(f"{cfg.trainer.run_name} ran again")

    monkeypatch.setattr(launch, "run_grpo", must_not_run)
    assert main(argv) == 0
    assert capsys.readouterr().out.count("finished before; skipped") == 2


def test_a_run_that_fails_in_its_process_is_recorded_and_the_other_finishes(tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    paths = f"trainer.policy.model.path={digits_policy()},{broken}"
    assert main(_argv(tmp_path, "trainer.max_steps=1", paths)) == 1
    rows = _rows(tmp_path)
    assert [r["status"] for r in rows] == ["finished", "failed"]
    failed = tmp_path / "runs" / "sweep" / rows[1]["name"]
    assert rows[1]["error"] == error_line(failed / LOG_FILE) and rows[1]["error"]
    assert not (failed / FINISHED_FILE).exists()
    assert "failed: " in capsys.readouterr().out


def test_a_stopped_sweep_stops_its_running_runs_which_save_first(tmp_path):
    argv = _argv(
        tmp_path,
        f"trainer.policy.model.path={digits_policy()}",
        "trainer.max_steps=400",
        "trainer.ckpt_interval=400",
        f"{LR}=1e-3,3e-3",
    )
    sweep = tmp_path / "runs" / "sweep"

    def stop_once_both_step() -> None:  # SIGTERM to the sweep, as a scheduler would send it
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            logs = [sweep / n / "metrics.jsonl" for n in ("lr=1e-3", "lr=3e-3")]
            if all(p.is_file() and p.stat().st_size for p in logs):
                break
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    stopper = threading.Thread(target=stop_once_both_step)
    stopper.start()
    try:
        assert main(argv) == 130
    finally:
        stopper.join()
    rows = _rows(tmp_path)
    assert [r["status"] for r in rows] == ["stopped", "stopped"]
    for row in rows:
        run = sweep / row["name"]
        assert not (run / FINISHED_FILE).exists()
        assert 1 <= row["steps"] < 400
        assert any((run / "ckpts").glob("global_step_*"))  # each saved the step it reached


def test_jobs_without_m_is_refused_with_what_it_needs(capsys):
    assert main(["train", "--jobs", "2", "trainer.max_steps=1"]) == 2
    assert "needs -m" in capsys.readouterr().err


def test_each_run_gets_its_share_of_the_cores_unless_the_threads_are_set(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert child_env(4)["OMP_NUM_THREADS"] == "4"
    assert child_env(32)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert child_env(4)["OMP_NUM_THREADS"] == "2"


def test_each_run_gets_its_share_of_the_gpus_memory_unless_set_or_on_the_cpu():
    def share(jobs: int, *overrides: str) -> float | None:
        return gpu_share(load_config(None, list(overrides)), jobs).trainer.gpu_memory_fraction

    assert share(4) == 0.25
    assert share(3) == 0.333
    assert share(1) is None  # alone: no cap
    assert share(4, "trainer.device=cpu") is None
    assert share(4, "trainer.gpu_memory_fraction=0.4") == 0.4


def test_runs_placed_on_ray_are_refused_side_by_side(tmp_path, capsys):
    argv = _argv(tmp_path, "trainer.policy.model.path=/no/model", f"{LR}=1e-3,3e-3")
    assert main([*argv, "trainer.placement.num_cpu_workers=2"]) == 2
    err = capsys.readouterr().err
    assert "several workers on Ray" in err and "--jobs 1" in err and "lr=1e-3, lr=3e-3" in err
    assert not (tmp_path / "runs").exists()  # refused before anything was written
