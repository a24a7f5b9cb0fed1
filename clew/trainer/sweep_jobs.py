"""A sweep's runs side by side, ``clew train -m --jobs N``: each combination in a child process.

A small policy's GRPO step is bound by the host (BENCHMARKS.md, "The small-model regime"):
one run leaves most of a GPU's time idle while Python prepares the next kernels. Runs in
processes of their own each bring their own interpreter, so ``N`` of them share one device
and its CPU cores, as Hydra's joblib launcher runs a multirun's jobs side by side or Ray
Tune runs trials with a fraction of a GPU each. A child process rather than a Ray actor:
nothing needs placing beyond this machine, and a run's crash (out of memory, a killed
process) is its own exit code, recorded, not the sweep's end.

Each child is ``clew train --config RUN_DIR`` on the combination's resolved config, written
to ``RUN_DIR/config.yaml`` first (what the run saves anyway), its output in
``RUN_DIR/train.log``; unless the run trains on the CPU or sets it, its
``trainer.gpu_memory_fraction`` is ``1/jobs``, so no run's cached memory starves the others
of the GPU's. At most ``jobs`` run at once, in the sweep's order; as each ends its
row of ``sweep.json`` is updated as the in-process sweep updates it: ``finished`` (exit 0;
``finished.json`` holds the last evaluation it logged, ``last_eval``), ``failed`` (the log's
last line as the error) or ``stopped``. SIGINT or SIGTERM to the sweep passes SIGTERM to
every child, each of which saves and stops (``clew.trainer.stopping``); the sweep waits for
them, writes the summary and raises ``KeyboardInterrupt``. The same command goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from clew.config import ClewConfig, save_config
from clew.errors import ConfigError
from clew.trainer.pipeline import updated

LOG_FILE = "train.log"
POLL_S = 0.5  # how often the running children are checked


@dataclass
class _Child:
    index: int  # the combination's place in the sweep, from 1
    run: Any  # clew.trainer.sweep.SweepRun
    row: dict[str, Any]
    proc: subprocess.Popen
    log: IO[bytes]


def check_side_by_side(runs: list[tuple[str, ClewConfig]], jobs: int) -> None:
    """Refuse runs that place more than one worker on Ray (``trainer.placement``: several
    GPUs or CPU workers): side by side, each would place its own on the same devices."""
    placed = [name for name, cfg in runs if cfg.trainer.placement.num_workers > 1]
    if placed:
        raise ConfigError(
            f"--jobs {jobs} runs combinations side by side on this machine's devices, but "
            f"{', '.join(placed)} place(s) several workers on Ray (trainer.placement: "
            "policy_num_nodes x policy_num_gpus_per_node, num_cpu_workers), which would each "
            "claim the same devices: run them with --jobs 1 (one after another)"
        )


def last_eval(run_dir: Path) -> dict[str, float]:
    """The ``eval/...`` metrics of the last evaluation ``run_dir/metrics.jsonl`` holds (what
    an in-process run returns); empty when it logged none."""
    found: dict[str, float] = {}
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        evals = {k: v for k, v in record.items() if k.startswith("eval/")}
        if evals:
            found = evals
    return found


def error_line(log_path: Path) -> str:
    """A failed child's error: the last non-empty line of its log."""
    try:
        lines = log_path.read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1].strip() if lines else "the run ended without output"


@contextmanager
def _stop_raises() -> Iterator[None]:
    """Within the block SIGTERM raises ``KeyboardInterrupt``, as SIGINT does."""

    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run_side_by_side(
    runs: list[tuple[int, Any, dict[str, Any]]],
    jobs: int,
    *,
    ended: Callable[[Any, dict[str, Any]], None],
    say: Callable[[str], None],
    total: int,
) -> None:
    """Run ``runs`` ((index, SweepRun, its summary row) not finished before) as child
    processes, at most ``jobs`` at once. ``ended(run, row)`` is called as each ends, its
    ``status`` (and a failed one's ``error``) set; on SIGINT or SIGTERM the children are
    stopped and waited for, each ended, and ``KeyboardInterrupt`` raised."""
    waiting, active = list(runs), []
    stopping = False

    def finish(child: _Child, code: int) -> None:
        child.log.close()
        name = child.row["name"]
        if stopping:
            child.row["status"] = "stopped"
        elif code == 0:
            child.row["status"] = "finished"
        else:
            child.row.update(status="failed", error=error_line(child.run.run_dir / LOG_FILE))
            say(f"run {child.index} of {total}, {name} failed: {child.row['error']}")
        ended(child.run, child.row)

    try:
        with _stop_raises():
            while waiting or active:
                while waiting and len(active) < jobs:
                    active.append(_start(*waiting.pop(0), say=say, total=total, jobs=jobs))
                time.sleep(POLL_S)
                for child in [c for c in active if c.proc.poll() is not None]:
                    active.remove(child)
                    finish(child, child.proc.returncode)
    except KeyboardInterrupt:
        stopping = True
        say(f"stopping {len(active)} running run(s); each saves first")
        for child in active:
            child.proc.send_signal(signal.SIGTERM)
        for child in active:
            finish(child, _wait(child.proc))
        raise


def child_env(jobs: int) -> dict[str, str]:
    """The environment of a run's process: this one's, with ``OMP_NUM_THREADS`` (torch's
    threads for CPU work) set to the machine's cores shared among ``jobs`` unless it is set
    already, as torchrun sets it for processes that share a machine; without it each run
    would start a thread per core and the runs would contend for the cores."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    return env


def gpu_share(cfg: ClewConfig, jobs: int) -> ClewConfig:
    """``cfg`` as a run among ``jobs`` on one machine: ``trainer.gpu_memory_fraction`` 1/jobs
    (rounded down) unless it is set, or the run trains on the CPU, or runs alone. Without it
    each run's caching allocator would hold its own peak and leave the others short."""
    t = cfg.trainer
    if jobs < 2 or t.device == "cpu" or t.gpu_memory_fraction is not None:
        return cfg
    return updated(cfg, {"trainer.gpu_memory_fraction": int(1000 / jobs) / 1000})


def _start(index: int, run: Any, row: dict[str, Any], *, say, total: int, jobs: int) -> _Child:
    """Start the child of one combination, its config written where ``--config`` reads it."""
    save_config(gpu_share(run.cfg, jobs), run.run_dir)
    log = (run.run_dir / LOG_FILE).open("ab")
    cmd = [sys.executable, "-m", "clew.cli", "train", "--config", str(run.run_dir)]
    # A session of its own: a terminal's Ctrl-C reaches the sweep alone, which passes one
    # SIGTERM on (a second signal would stop the run unsaved).
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=child_env(jobs),
    )
    row["status"] = "running"
    say(f"run {index} of {total}, {row['name']}: {run.run_dir} (process {proc.pid}, {LOG_FILE})")
    return _Child(index, run, row, proc, log)


def _wait(proc: subprocess.Popen) -> int:
    """The child's exit code once it ends; a second interrupt stops waiting and kills it."""
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.kill()
        return proc.wait()
