"""A one-picture answer to "did this run learn?", drawn from ``metrics.jsonl`` alone.

:func:`draw_report` plots the eval solve rate (``eval/all/pass_at_1``) with the training
reward and solve rate against step, and, when the history has ``timing/step``, against
cumulative wall-clock minutes too (what a speed-up is judged by). :func:`summarize` gives the
same story as numbers for tables and benchmark write-ups.

Only the history file is read, so a report works for a run in progress, a killed one, or one
copied off a cluster without its checkpoints. Drawing uses matplotlib's Agg canvas on a bare
``Figure`` rather than ``pyplot``, so it needs no display and never changes the process-wide
backend of a caller (a notebook, the trainer).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from clew.errors import DataError
from clew.metrics.history import METRICS_FILE, read_history

EVAL_KEY = "eval/all/pass_at_1"
TRAIN_KEYS: tuple[str, ...] = ("train/reward_mean", "train/solve_rate")
STEP_TIME_KEY = "timing/step"
REPORT_FILE = "report.png"

_STYLE = {
    EVAL_KEY: {"label": "eval pass@1", "marker": "o", "linewidth": 2.0, "color": "tab:red"},
    "train/reward_mean": {"label": "train reward", "linewidth": 1.0, "color": "tab:blue"},
    "train/solve_rate": {"label": "train solve rate", "linewidth": 1.0, "color": "tab:green"},
}


def _load(run_dir: Path) -> list[dict[str, Any]]:
    records = read_history(run_dir)
    if not records:
        raise DataError(
            f"no metrics in {str(run_dir)!r}: {METRICS_FILE} is missing or empty "
            "(is this a clew run directory, and has it logged a step?)"
        )
    return records


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _wall_minutes(records: list[dict[str, Any]]) -> list[float] | None:
    """Cumulative wall minutes at each record, or ``None`` if no step was timed."""
    if not any(STEP_TIME_KEY in r for r in records):
        return None
    elapsed, out = 0.0, []
    for record in records:
        seconds = record.get(STEP_TIME_KEY)
        # An eval logged as its own record at a step adds no time of its own.
        if _finite(seconds):
            elapsed += seconds
        out.append(elapsed / 60.0)
    return out


def _series(
    records: list[dict[str, Any]], xs: list[float], key: str
) -> tuple[list[float], list[float]]:
    points = [(x, r[key]) for x, r in zip(xs, records, strict=True) if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def draw_report(
    run_dir: str | os.PathLike[str],
    output_png: str | os.PathLike[str] | None = None,
    *,
    title: str | None = None,
) -> Path:
    """Plot a run's learning curves to a PNG and return its path.

    Writes ``<run_dir>/report.png`` unless ``output_png`` is given; the title defaults to the
    run directory's name. Raises ``DataError`` if the run has no metrics, or none of the
    plotted ones.
    """
    # Imported here so that importing clew.metrics (done by every training run) stays cheap.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    records = _load(run_dir)
    keys = [k for k in (EVAL_KEY, *TRAIN_KEYS) if any(k in r for r in records)]
    if not keys:
        wanted = ", ".join((EVAL_KEY, *TRAIN_KEYS))
        raise DataError(f"{run_dir / METRICS_FILE} has none of the plotted metrics ({wanted})")

    minutes = _wall_minutes(records)
    steps = [float(r["step"]) for r in records]
    axes_spec: list[tuple[str, list[float]]] = [("step", steps)]
    if minutes is not None:
        axes_spec.append(("wall-clock minutes", minutes))

    fig = Figure(figsize=(6.0 * len(axes_spec), 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(axes_spec), squeeze=False)[0]
    for ax, (xlabel, xs) in zip(axes, axes_spec, strict=True):
        for key in keys:
            px, py = _series(records, xs, key)
            style = dict(_STYLE[key])
            if key == EVAL_KEY and len(px) > 30:
                # Markers on every point of a dense eval curve just blot the line.
                style.pop("marker")
            ax.plot(px, py, **style)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("rate / reward")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(title or run_dir.resolve().name)

    out = Path(output_png) if output_png is not None else run_dir / REPORT_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def summarize(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The run in numbers: steps, eval pass@1 (first, last, best and where), wall time.

    Keys: ``run_name``, ``steps`` (last logged step), ``records``, ``first_pass_at_1``,
    ``last_pass_at_1``, ``best_pass_at_1``, ``best_step``, ``evals`` (how many evals),
    ``last_reward_mean`` and ``wall_minutes``; a value is ``None`` when the history lacks it.
    Non-finite evals are left out of best/first/last.
    """
    run_dir = Path(run_dir)
    records = _load(run_dir)
    evals = [(r["step"], r[EVAL_KEY]) for r in records if _finite(r.get(EVAL_KEY))]
    rewards = [r[TRAIN_KEYS[0]] for r in records if TRAIN_KEYS[0] in r]
    best = max(evals, key=lambda e: e[1]) if evals else None
    minutes = _wall_minutes(records)
    return {
        "run_name": run_dir.resolve().name,
        "steps": max(r["step"] for r in records),
        "records": len(records),
        "first_pass_at_1": evals[0][1] if evals else None,
        "last_pass_at_1": evals[-1][1] if evals else None,
        "best_pass_at_1": best[1] if best else None,
        "best_step": best[0] if best else None,
        "evals": len(evals),
        "last_reward_mean": rewards[-1] if rewards else None,
        "wall_minutes": minutes[-1] if minutes else None,
    }
