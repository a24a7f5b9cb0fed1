"""Spreading a step's rollouts over data-parallel workers by expected cost.

A step's rollouts end when the slowest worker's do, so the rows (each a GRPO group of
``n_samples_per_prompt`` episodes, never split: its advantages compare its own samples) go
to workers by expected cost: the longest first, each to the worker with the least work so
far (the LPT rule, within 4/3 of the best split). A row's expected cost is the turns its
episodes are expected to take: the expert's ``turns_needed`` where the dataset row records
it (capped by the row's turn budget), else the budget itself. Rows of equal cost keep
their order, and rows all of one cost (unknown, say) fall into contiguous, count-balanced
chunks.

(An update's sequences are split by count: ``TrainingBatch.split``.)
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from clew.data.rows import Row


def expected_cost(row: Row) -> float:
    """Turns the row's episodes are expected to take."""
    needed = row.turns_needed
    budget = row.max_turns
    if needed is None or needed <= 0:
        return float(budget)
    return float(min(needed, budget)) if budget else float(needed)


def count_split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[lo, hi)`` ranges over ``n`` items, sizes differing by one
    at most (the first ones larger), some empty when ``n < parts``."""
    bounds = [0]
    for p in range(parts):
        bounds.append(bounds[-1] + n // parts + (p < n % parts))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def assign_rows(costs: Sequence[float], num_workers: int) -> list[list[int]]:
    """Row indices for each of at most ``num_workers`` workers (none left empty), each list
    in row order, balancing the summed ``costs`` (LPT)."""
    n = len(costs)
    k = min(n, num_workers)
    if k <= 1:
        return [list(range(n))] if n else []
    if len(set(costs)) == 1:  # nothing to balance: contiguous chunks, as a count split
        return [list(range(lo, hi)) for lo, hi in count_split(n, k)]
    order = sorted(range(n), key=lambda i: (-costs[i], i))  # ties by row order
    heap = [(0.0, w) for w in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, w = heapq.heappop(heap)
        parts[w].append(i)
        heapq.heappush(heap, (load + costs[i], w))
    return sorted((sorted(p) for p in parts), key=lambda p: p[0])
