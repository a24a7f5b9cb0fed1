"""Greedy eval pass@1 against step for a chain of runs: SFT, then GRPO, then GRPO continued.

    python benchmarks/research/plot_learning_curve.py RUN/sft/metrics.jsonl RUN/grpo/metrics.jsonl \
        --output curve.png [--mark STEP=LABEL ...] [--target 0.95]

Each file is one run's ``metrics.jsonl`` (one JSON object a line, each with ``step``). A
file's steps continue from the previous file's last step, so a run that went on from an
earlier run's exported policy reads as one curve. A file is drawn as SFT when its rows
carry ``sft/`` metrics, as GRPO otherwise; the last SFT evaluation is marked as the start
of GRPO. ``--mark`` labels a step of the chain (where a setting changed, say).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

KEY = "eval/all/pass_at_1"
COLOURS = {"SFT": "tab:blue", "GRPO": "tab:red"}


@dataclass
class Segment:
    phase: str  # "SFT" or "GRPO"
    points: list[tuple[int, float]]  # (step along the whole chain, percent)


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise SystemExit(f"{path}: no such metrics file (a run folder's metrics.jsonl)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows or any("step" not in r for r in rows):
        raise SystemExit(f"{path}: expected one JSON object with a 'step' a line")
    # A resumed run logs the steps after its checkpoint again: the later row wins.
    by_step = {int(r["step"]): r for r in rows}
    return [by_step[s] for s in sorted(by_step)]


def chain(paths: list[Path], key: str = KEY) -> list[Segment]:
    """One segment a file, each file's steps offset by the chain's steps so far."""
    segments, offset = [], 0
    for path in paths:
        rows = read_rows(path)
        phase = "SFT" if any(k.startswith("sft/") for r in rows for k in r) else "GRPO"
        points = [(offset + int(r["step"]), 100.0 * r[key]) for r in rows if key in r]
        if not points:
            raise SystemExit(f"{path}: no '{key}' in any row (was data.val_data set?)")
        segments.append(Segment(phase, points))
        offset += int(rows[-1]["step"])
    return segments


def best_line(segments: list[Segment]) -> str:
    """The best GRPO evaluation, its step counted from the end of SFT (or the best SFT one)."""
    grpo = [seg for seg in segments if seg.phase == "GRPO"]
    sft_end = max((seg.points[-1][0] for seg in segments if seg.phase == "SFT"), default=0)
    pool, phase, zero = (grpo, "GRPO", sft_end) if grpo else (segments, "SFT", 0)
    value, step = max((v, s) for seg in pool for s, v in seg.points)
    return f"greedy eval pass@1; best {phase} evaluation {value:.1f}% at {phase} step {step - zero}"


def plot(
    segments: list[Segment], output: Path, marks: dict[int, str], target: float | None
) -> None:
    fig = Figure(figsize=(8, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    seen: set[str] = set()
    for seg in segments:
        label = None if seg.phase in seen else seg.phase
        seen.add(seg.phase)
        steps, values = zip(*seg.points, strict=True)
        ax.plot(steps, values, "o-", ms=2.5, lw=1.2, color=COLOURS[seg.phase], label=label)
    sft = [seg for seg in segments if seg.phase == "SFT"]
    if sft and len(sft) < len(segments):
        step, value = sft[-1].points[-1]
        ax.axvline(step, color="gray", linewidth=0.8)
        ax.plot([step], [value], "D", color="black", markersize=6)
        text = f"SFT start of GRPO: {value:.1f}%"
        ax.annotate(text, (step, value), xytext=(8, -16), textcoords="offset points", fontsize=8)
    for step, text in sorted(marks.items()):
        ax.axvline(step, color="gray", linestyle=":", linewidth=0.8)
        ax.annotate(
            text, (step, 4), xytext=(3, 0), textcoords="offset points", fontsize=7, rotation=90
        )
    if target is not None:
        ax.axhline(100 * target, color="gray", linestyle="--", linewidth=0.8)
    ax.set_title(best_line(segments), fontsize=9)
    ax.set_xlabel("step (SFT steps, then GRPO steps)")
    ax.set_ylabel("eval pass@1 (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=100)


def parse_marks(items: list[str]) -> dict[int, str]:
    marks = {}
    for item in items:
        step, sep, text = item.partition("=")
        if not sep or not step.strip().isdigit():
            raise SystemExit(f"--mark {item!r}: expected STEP=LABEL, e.g. 269=turn_discount")
        marks[int(step)] = text
    return marks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", nargs="+", type=Path, help="metrics.jsonl files, in chain order")
    ap.add_argument("--output", type=Path, default=Path("curve.png"))
    ap.add_argument("--key", default=KEY, help="the metric drawn (a fraction in [0, 1])")
    ap.add_argument("--mark", action="append", default=[], help="STEP=LABEL, repeatable")
    ap.add_argument("--target", type=float, default=None, help="a dashed line at this rate")
    args = ap.parse_args()
    segments = chain(args.metrics, args.key)
    for seg in segments:
        print(seg.phase, " ".join(f"{s}:{v:.1f}" for s, v in seg.points))
    plot(segments, args.output, parse_marks(args.mark), args.target)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
