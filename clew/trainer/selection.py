"""The selection set: which evaluation figure picks the policy GRPO keeps as its best.

GRPO reports its evaluations on the fixed eval set (``data.val_data``). Picking the best
step by that same figure overstates it: the highest of several noisy estimates is biased
upward. ``data.select_data`` is a second set of rows, played at each evaluation in the
same rollout as the eval rows (the same settings and seed), whose pass@1
(``select/all/pass_at_1``) picks the policy ``trainer.export_best`` keeps; the eval figure
of the kept step is then not the one that chose it. Without selection rows the eval
set's pass@1 picks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from clew.data.rows import Row
from clew.rollout.evaluation import eval_metrics
from clew.rollout.trajectory import Trajectory

EVAL_METRIC = "eval/all/pass_at_1"
SELECT_METRIC = "select/all/pass_at_1"


def picking_metric(has_select: bool) -> str:
    """The metric that picks the best policy: the selection set's when there is one."""
    return SELECT_METRIC if has_select else EVAL_METRIC


def split_evaluation(
    trajs: Sequence[Trajectory], num_eval: int
) -> tuple[list[Trajectory], list[Trajectory]]:
    """The trajectories of one rollout over the eval rows followed by the selection rows,
    split into the eval rows' and the selection rows'. A trajectory's ``group_id`` is its
    row's index in the rollout, so the selection ones are renumbered from 0, as a rollout
    of the selection rows alone would number them."""
    evals = [t for t in trajs if t.group_id < num_eval]
    chosen = [t for t in trajs if t.group_id >= num_eval]
    for t in chosen:
        t.group_id -= num_eval
    return evals, chosen


def select_metrics(
    trajs: Sequence[Trajectory], rows: Sequence[Row], max_turns: int
) -> dict[str, float]:
    """``eval_metrics`` of the selection rows, each named ``select/...`` for ``eval/...``."""
    return {
        "select/" + key.removeprefix("eval/"): value
        for key, value in eval_metrics(trajs, rows, max_turns).items()
    }


def best_evaluation(history: Sequence[Mapping[str, Any]]) -> tuple[str, int, float] | None:
    """The evaluation ``trainer.export_best`` keeps, read back from a run's logged history:
    (the metric that picked, its step, the metric's value). The selection set's pass@1
    picks where the run logged one, else the eval set's; ties keep the earlier step. None
    when the history holds no evaluation."""
    for metric in (SELECT_METRIC, EVAL_METRIC):
        found = [
            (int(h["step"]), float(h[metric]))
            for h in history
            if isinstance(h.get(metric), int | float) and math.isfinite(h[metric])
        ]
        if found:
            step, value = max(found, key=lambda e: (e[1], -e[0]))
            return metric, step, value
    return None


def beats_best(state: Any, metric: str, value: float, step: int) -> bool:
    """Whether ``value`` of ``metric`` at ``step`` beats the best so far in ``state`` (a
    GRPO ``LoopState``: ``best_eval``, ``best_step``, ``best_metric``), recording it there
    when it does; ties keep the earlier step. A best that ``state`` holds of another metric
    (a run resumed with the selection set added or removed) is not compared with: values
    of two sets do not compare, so this evaluation starts the record again."""
    if state.best_metric != metric:
        if state.best_step >= 0:
            print(
                f"the best policy so far (step {state.best_step}) was picked by "
                f"{state.best_metric}; this run picks by {metric}, from this evaluation on",
                flush=True,
            )
        state.best_eval, state.best_metric = -1.0, metric
    if value <= state.best_eval:
        return False
    state.best_eval, state.best_step = value, step
    return True
