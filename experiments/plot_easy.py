"""Eval pass@1 of the GPU `easy` run against step and device wall time: SFT, then GRPO.

    python experiments/plot_easy.py [RESULTS_DIR | METRICS_JSONL ...] [OUT_PNG]

Each RESULTS_DIR (default docs/results/easy-h200) holds the metrics that
`experiments/gpu_easy.sh` wrote, named by phase order: ``1_sft_metrics.jsonl``,
``2_sft_more_metrics.jsonl`` (SFT, ``sft/elapsed_s`` per step) and
``3_grpo_metrics.jsonl`` (GRPO, ``timing/step`` per step, evaluation included). Time runs
on from one phase to the next, and from one folder to the next (a run carried on over
sessions); setup, data and packing between calls are left out. A GRPO call went on from
the last policy the previous call exported (the step before a row with ``timing/export``:
an export's time is logged with the next step; the last step if the call's log beside
the metrics, ``N_grpo.log``, does not say it was interrupted), so the steps that call ran
past its export are left out too. A metrics file named instead of a folder is taken as it
is, in the order given (SFT unless "grpo" is in its name), so one chain can be drawn from
the files of several sessions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

KEY = "eval/all/pass_at_1"


def curves(*folders: Path) -> list[tuple[str, list[int], list[float], list[float]]]:
    out = []
    step0 = time0 = 0.0
    paths = [
        p for f in folders for p in ([f] if f.is_file() else sorted(f.glob("*_metrics.jsonl")))
    ]
    for path in paths:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        grpo = "grpo" in path.name
        steps, seconds, values = [], [], []
        clock = 0.0
        exported = previous = None
        for r in rows:
            if grpo and "timing/export" in r:
                exported = previous
            clock = clock + r.get("timing/step", 0.0) if grpo else r["sft/elapsed_s"]
            previous = (step0 + r["step"], time0 + clock)
            if KEY in r:
                steps.append(int(step0 + r["step"]))
                seconds.append(time0 + clock)
                values.append(100 * r[KEY])
        log = path.with_name(path.name.replace("_metrics.jsonl", ".log"))
        if grpo and log.exists() and "interrupted" not in log.read_text():
            exported = previous  # a run that ended at max_steps exports its last step
        out.append(("GRPO" if grpo else "SFT", steps, seconds, values))
        if exported is not None:
            step0, time0 = exported
        else:
            step0 += max(r["step"] for r in rows)
            time0 += clock
    return out


def main() -> None:
    args = [Path(a) for a in sys.argv[1:]]
    target = args.pop() if args and args[-1].suffix == ".png" else None
    folders = args or [Path("docs/results/easy-h200")]
    target = target or (folders[-1].parent if folders[-1].is_file() else folders[-1]) / "curve.png"
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    by_step, by_time = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    colours = {"SFT": "tab:blue", "GRPO": "tab:red"}
    seen = set()
    for phase, steps, seconds, values in curves(*folders):
        label = None if phase in seen else phase
        seen.add(phase)
        by_step.plot(steps, values, "o-", color=colours[phase], label=label)
        by_time.plot([s / 60 for s in seconds], values, "o-", color=colours[phase], label=label)
        for s, v in zip(steps, values, strict=True):
            print(f"{phase:5s} step {s:4d}  {v:5.1f}%")
    for ax, xlabel in ((by_step, "step (SFT steps, then GRPO steps)"), (by_time, "minutes")):
        ax.axhline(95, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval pass@1 on 64 maze_2d/easy mazes (%)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("maze_2d/easy on one H200: SFT from scratch, then GRPO (target 95%)")
    fig.tight_layout()
    fig.savefig(target, dpi=90)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
