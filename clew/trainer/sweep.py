"""A sweep, ``clew train -m``: one GRPO run per combination of a grid, one after another, or
``--jobs N`` of them side by side in processes of their own (``clew.trainer.sweep_jobs``).

The grid is the command's ``key=a,b`` overrides (``clew.config.sweep``). Everything lands
under the sweep's folder SWEEP = ``trainer.log_path/trainer.run_name``::

    SWEEP/<combination>/               a run like any other (config.yaml, metrics.jsonl,
                                       ckpts/, exports/); its trainer.run_name is
                                       '<trainer.run_name>/<combination>'
    SWEEP/<combination>/finished.json  written when the run ended on its own: a digest of
                                       the resolved config it ran with
    SWEEP/sweep.json                   the summary: one row per combination

Every combination's config is built and validated before the first run starts, so a bad
value in any of them is a ``ConfigError`` naming the combination, with nothing run. A
``trainer.ckpt_path`` or ``trainer.export_path`` set for all of them gets the combination's
name appended, so that no run resumes or overwrites another's.

Re-running the same command goes on, as ``clew pipeline`` does: a combination whose
``finished.json`` holds the digest of its config now is skipped; any other runs, and resumes
its latest checkpoint as every run does (``trainer.resume_mode``, 'latest' by default). A
changed setting (more ``trainer.max_steps``) changes the digest: that run goes on.

A run that raises is recorded as failed, with its error's one line, and the sweep goes on
with the next. A run stopped by SIGINT or SIGTERM (saved, ``clew.trainer.stopping``) ends
the sweep: the summary is written and ``KeyboardInterrupt`` raised.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clew.config import ClewConfig, config_yaml, load_config
from clew.config.sweep import Combination, Grid, parse_grid
from clew.errors import ClewError, ConfigError, DataError
from clew.trainer import launch
from clew.trainer.pipeline import updated
from clew.trainer.stage_records import write_json

FINISHED_FILE = "finished.json"
SUMMARY_FILE = "sweep.json"
METRIC = "eval/all/pass_at_1"  # clew.metrics.report's, what summarize() reads


def say(msg: str) -> None:
    print(f"[sweep {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class SweepRun:
    """One combination and the validated config it runs with."""

    combination: Combination
    cfg: ClewConfig

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.trainer.log_path) / self.cfg.trainer.run_name


@dataclass(frozen=True)
class Sweep:
    """A planned sweep: its ``folder``, its ``grid`` and one run per combination, in order."""

    folder: Path
    grid: Grid
    runs: tuple[SweepRun, ...]


def plan_sweep(config: str | Path | None, overrides: list[str] | tuple[str, ...]) -> Sweep:
    """Build and validate every combination's config; raises ``ConfigError`` naming the first
    combination that fails (``sweep run I of N (NAME): ...``) before anything is written."""
    grid = parse_grid(overrides)
    combinations = grid.combinations()
    runs, folder = [], None
    for i, combination in enumerate(combinations, 1):
        try:
            cfg = load_config(config, combination.overrides)
            folder = Path(cfg.trainer.log_path) / cfg.trainer.run_name
            cfg = _placed(cfg, combination.name, grid)
            launch.check_runnable(cfg)
        except ConfigError as exc:
            raise ConfigError(
                f"sweep run {i} of {len(combinations)} ({combination.name}): {exc}"
            ) from None
        runs.append(SweepRun(combination, cfg))
    assert folder is not None  # a grid has at least one combination
    return Sweep(folder, grid, tuple(runs))


def _placed(cfg: ClewConfig, name: str, grid: Grid) -> ClewConfig:
    """``cfg`` as the combination ``name`` runs it: in its folder under the sweep's, and with
    a ``ckpt_path``/``export_path`` that every combination shares made its own."""
    from clew.checkpoint.storage import join

    t, swept = cfg.trainer, {a.key for a in grid.axes}
    values: dict[str, Any] = {"trainer.run_name": f"{t.run_name}/{name}"}
    for key, path in {
        "trainer.ckpt_path": t.ckpt_path,
        "trainer.export_path": t.export_path,
    }.items():
        if path and key not in swept:
            values[key] = join(path, name)
    return updated(cfg, values)


def digest(cfg: ClewConfig) -> str:
    """The sha256 of the resolved config (the text a run saves as config.yaml)."""
    return hashlib.sha256(config_yaml(cfg).encode()).hexdigest()


def finished(run: SweepRun) -> bool:
    """Whether ``run`` ended on its own before, with the config it has now."""
    path = run.run_dir / FINISHED_FILE
    try:
        return json.loads(path.read_text()).get("config_sha256") == digest(run.cfg)
    except (OSError, ValueError, AttributeError):
        return False


def mark_finished(run: SweepRun, last_eval: dict[str, float]) -> None:
    run.run_dir.mkdir(parents=True, exist_ok=True)
    path = run.run_dir / FINISHED_FILE
    record = {
        "config_sha256": digest(run.cfg),
        "finished_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "last_eval": last_eval,
    }
    write_json(path, record)


def run_sweep(sweep: Sweep, jobs: int = 1) -> list[dict[str, Any]]:
    """Run the sweep's combinations in order, ``jobs`` at a time (more than 1: each in a
    child process, ``clew.trainer.sweep_jobs``); returns the summary's rows (``sweep.json``).

    Each row: ``name``, ``run_dir``, ``overrides`` (the axes' values by key), ``status``
    ('finished', 'failed', 'stopped', 'interrupted' or 'pending'), ``skipped`` (finished by
    an earlier command), ``error`` (a failed run's one line), and from the run's metrics
    (``clew.metrics.summarize``) ``steps``, ``evals``, ``last_pass_at_1``,
    ``best_pass_at_1``, ``best_step``.
    """
    from clew.trainer.stopping import GracefulStop

    if jobs > 1:  # before anything is written
        from clew.trainer.sweep_jobs import check_side_by_side

        check_side_by_side([(run.combination.name, run.cfg) for run in sweep.runs], jobs)
    rows = [_row(run) for run in sweep.runs]
    write_summary(sweep, rows)
    if jobs > 1:
        return _run_side_by_side(sweep, rows, jobs)
    n, shown = len(rows), False
    current: dict[str, Any] | None = None
    try:
        for i, (run, row) in enumerate(zip(sweep.runs, rows, strict=True), 1):
            if row["skipped"]:
                say(f"run {i} of {n}, {row['name']}: finished before; skipped")
                continue
            say(f"run {i} of {n}, {row['name']}: {run.run_dir}")
            current, stops = row, GracefulStop.stops
            row["status"] = "running"
            try:
                last_eval = launch.run_grpo(run.cfg)
            except Exception as exc:  # noqa: BLE001 - recorded; the sweep goes on
                row.update(status="failed", error=one_line(exc))
                if not isinstance(exc, ClewError):
                    traceback.print_exc()
                say(f"run {i} of {n}, {row['name']} failed: {row['error']}")
            else:
                if GracefulStop.stops != stops:
                    row["status"] = "stopped"
                    raise KeyboardInterrupt
                mark_finished(run, last_eval)
                row["status"] = "finished"
            current = None
            row.update(_metrics(run))
            write_summary(sweep, rows)
            print(summary_table(rows), flush=True)
            shown = i == n
            _free_memory()
    except KeyboardInterrupt:
        if current is not None:
            if current["status"] == "running":
                current["status"] = "interrupted"
            current.update(_metrics(sweep.runs[rows.index(current)]))
        write_summary(sweep, rows)
        print(summary_table(rows), flush=True)
        say(f"stopped; the same command goes on: {sweep.folder / SUMMARY_FILE}")
        raise
    write_summary(sweep, rows)
    if not shown:
        print(summary_table(rows), flush=True)
    say(f"summary: {sweep.folder / SUMMARY_FILE}")
    return rows


def _run_side_by_side(sweep: Sweep, rows: list[dict[str, Any]], jobs: int) -> list[dict[str, Any]]:
    from clew.trainer.sweep_jobs import last_eval, run_side_by_side

    n = len(rows)
    for i, row in enumerate(rows, 1):
        if row["skipped"]:
            say(f"run {i} of {n}, {row['name']}: finished before; skipped")
    todo = [(i, r, row) for i, (r, row) in enumerate(zip(sweep.runs, rows, strict=True), 1)]

    def ended(run: SweepRun, row: dict[str, Any]) -> None:
        if row["status"] == "finished":
            mark_finished(run, last_eval(run.run_dir))
        row.update(_metrics(run))
        write_summary(sweep, rows)
        print(summary_table(rows), flush=True)

    try:
        run_side_by_side(
            [t for t in todo if not t[2]["skipped"]], jobs, ended=ended, say=say, total=n
        )
    except KeyboardInterrupt:
        write_summary(sweep, rows)
        say(f"stopped; the same command goes on: {sweep.folder / SUMMARY_FILE}")
        raise
    say(f"summary: {sweep.folder / SUMMARY_FILE}")
    return rows


def _row(run: SweepRun) -> dict[str, Any]:
    done = finished(run)
    row: dict[str, Any] = {
        "name": run.combination.name,
        "run_dir": str(run.run_dir),
        "overrides": dict(run.combination.values),
        "status": "finished" if done else "pending",
        "skipped": done,
        "error": None,
    }
    return row | _metrics(run)


def _metrics(run: SweepRun) -> dict[str, Any]:
    """The run's numbers from its metrics.jsonl; None for each when it logged nothing."""
    from clew.metrics import summarize

    keys = ("steps", "evals", "last_pass_at_1", "best_pass_at_1", "best_step")
    try:
        summary = summarize(run.run_dir)
    except DataError:  # no folder or no record yet
        return dict.fromkeys(keys)
    return {k: summary[k] for k in keys}


def one_line(exc: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _free_memory() -> None:
    """What a finished or failed run left behind, dropped before the next loads its model."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def write_summary(sweep: Sweep, rows: list[dict[str, Any]]) -> Path:
    """``SWEEP/sweep.json``: the metric, the axes and the rows, written whole."""
    sweep.folder.mkdir(parents=True, exist_ok=True)
    path = sweep.folder / SUMMARY_FILE
    data = {
        "metric": METRIC,
        "axes": {a.key: list(a.values) for a in sweep.grid.axes},
        "runs": rows,
    }
    write_json(path, data)
    return path


def _number(value: float | None, step: int | None = None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" + ("" if step is None else f" @{step}")


def summary_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a plain-text table: run, status, steps, last and best eval pass@1, error."""
    head = ("run", "status", "steps", "last pass@1", "best pass@1 @step", "error")
    body = [
        (
            r["name"],
            r["status"] + (" (earlier)" if r["skipped"] else ""),
            "-" if r["steps"] is None else str(r["steps"]),
            _number(r["last_pass_at_1"]),
            _number(r["best_pass_at_1"], r["best_step"]),
            (r["error"] or "")[:100],
        )
        for r in rows
    ]
    widths = [max(len(line[c]) for line in (head, *body)) for c in range(len(head))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
        for line in (head, *body)
    ]
    return "\n".join(line.rstrip() for line in lines)
