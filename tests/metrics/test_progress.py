"""Progress lines of long phases: whole lines on a stream that is not a terminal, at most one
every few seconds plus the last, silence for short phases and when asked; the GRPO loop's
progress lines and per-phase peak memory from its worker group."""

from __future__ import annotations

import io

from clew.config import load_config
from clew.data.rows import generate_rows
from clew.metrics import progress as progress_module
from clew.metrics.progress import Progress
from clew.rollout.trajectory import Trajectory
from clew.trainer.grpo import GRPOTrainer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_long_phase_prints_throttled_lines_and_a_final_one_on_a_log_stream():
    out, clock = io.StringIO(), Clock()
    with Progress("step 3 generate", 192, stream=out, clock=clock, every_s=5) as progress:
        for _ in range(12):  # 16 episodes a second for 12 s
            clock.now += 1
            progress(16)
    lines = out.getvalue().splitlines()
    assert lines == [
        "step 3 generate: 80/192 episodes, 5.0 s",
        "step 3 generate: 160/192 episodes, 10.0 s",
        "step 3 generate: 192/192 episodes, 12.0 s",
    ]
    assert "\r" not in out.getvalue()


def test_a_phase_shorter_than_the_interval_prints_nothing():
    out, clock = io.StringIO(), Clock()
    with Progress("step 1 evaluate", 64, stream=out, clock=clock, every_s=5) as progress:
        clock.now += 4.9
        progress(64)
    assert out.getvalue() == ""


def test_a_disabled_reporter_stays_quiet_however_long_the_phase():
    out, clock = io.StringIO(), Clock()
    with Progress("step 1 generate", 8, stream=out, clock=clock, enabled=False) as progress:
        for _ in range(8):
            clock.now += 10
            progress(1)
    assert out.getvalue() == ""


def test_on_a_terminal_the_line_is_redrawn_in_place_and_ends_with_a_newline():
    out, clock = Terminal(), Clock()
    with Progress("step 2 generate", 4, stream=out, clock=clock, every_s=1) as progress:
        for _ in range(4):
            clock.now += 1
            progress(1)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert text.count("\r") == 4  # 1/4, 2/4, 3/4, then the final 4/4
    assert "step 2 generate: 4/4 episodes, 4.0 s" in text.split("\r")[-1]


class _MeasuringGroup:
    """A worker group without a model: every episode reports its end through ``progress``,
    and ``peak_memory_gb`` returns 1, 2, 3, ... GB, one more at each call."""

    world_size = 1

    def __init__(self) -> None:
        self.peaks = 0

    def generate(self, rows, settings, seed, progress=None):
        out = []
        for g, row in enumerate(rows):
            for s in range(settings.n_samples_per_prompt):
                t = Trajectory(row.env_id, {}, int(row.seed), g, s)
                t.reward = float(s == 0)
                out.append(t)
                if progress:
                    progress(1)
        return out

    def update(self, batch, settings):
        return {"policy/optimizer_steps": 1.0}

    def peak_memory_gb(self) -> float:
        self.peaks += 1
        return float(self.peaks)


class _Loggers:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, metrics, step):
        self.records.append(dict(metrics))


def test_the_grpo_loop_reports_rollout_progress_and_each_phases_peak_memory(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(progress_module, "EVERY_S", 0.0)  # every phase counts as long
    cfg = load_config(
        None,
        [
            "trainer.train_batch_size=2",
            "trainer.policy_mini_batch_size=1",
            "generator.n_samples_per_prompt=2",
            "trainer.eval_before_train=false",
            "trainer.max_steps=1",
            "trainer.eval_interval=1",
        ],
    )
    rows = generate_rows("maze_2d/small", 4, "train")
    loggers = _Loggers()
    GRPOTrainer(cfg, _MeasuringGroup(), rows, rows[:1], loggers, tmp_path).fit()
    lines = capsys.readouterr().out.splitlines()
    generate = [line for line in lines if line.startswith("step 1 generate: ")]
    assert [line.split(",")[0] for line in generate] == [
        f"step 1 generate: {n}/4 episodes" for n in (1, 2, 3, 4)
    ]
    assert any(line.startswith("step 1 evaluate: 1/1 episodes") for line in lines)
    # Each phase starts the group's count (a call) and reads it at its end (the next one).
    (step,) = [r for r in loggers.records if "perf/peak_memory_gb/update" in r]
    assert step["perf/peak_memory_gb/generate"] == 2.0
    assert step["perf/peak_memory_gb/update"] == 4.0
    assert step["perf/peak_memory_gb/evaluate"] == 6.0


def test_a_run_without_the_console_logger_prints_no_progress(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress_module, "EVERY_S", 0.0)
    overrides = [
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=1",
        "trainer.max_steps=1",
    ]
    cfg = load_config(None, [*overrides, "trainer.logger=jsonl", "trainer.eval_before_train=false"])
    rows = generate_rows("maze_2d/small", 4, "train")
    GRPOTrainer(cfg, _MeasuringGroup(), rows, [], _Loggers(), tmp_path).fit()
    assert "episodes" not in capsys.readouterr().out
