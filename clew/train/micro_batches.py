"""How a list of sequences is cut into the micro-batches of a forward pass: by count, by a
token budget (padded or packed), and sequences packed end to end into rows of a width.

Plain functions of lengths and indices; ``clew.train.forward.PolicyForward`` chooses among
them and ``clew.train.model_batch.collate`` lays the chosen sequences out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

__all__ = ["micro_batches", "pack_rows", "token_micro_batches"]


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Indices of sequences of ``lengths`` placed in rows of ``width`` tokens, first fit
    decreasing (each row's indices in the order they are laid out)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > width:
            raise ValueError(f"a sequence of {lengths[i]} tokens does not fit rows of {width}")
        row = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if row is None:
            rows.append([])
            free.append(width)
            row = len(rows) - 1
        rows[row].append(i)
        free[row] -= lengths[i]
    return rows


def micro_batches(items: Sequence[T], size: int) -> list[list[T]]:
    """``items`` in consecutive chunks of ``size`` (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"batch size must be a positive integer, got {size}")
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def token_micro_batches(
    items: Sequence[T], lengths: Sequence[int], budget: int, *, padded: bool
) -> list[list[T]]:
    """``items`` (of ``lengths`` tokens) in groups of at most ``budget`` tokens each.

    ``padded``: a group costs its count times its longest length (a right-padded batch), and
    groups are consecutive runs of the items sorted by length, which wastes least on
    padding. Otherwise a group costs the sum of its lengths (one packed row) and items are
    placed first fit decreasing (``pack_rows``). The budget is a soft cap, as SkyRL's
    ``max_tokens_per_microbatch``: an item longer than it forms a group of its own.
    """
    if budget < 1:
        raise ValueError(f"a token budget must be a positive integer, got {budget}")
    if len(items) != len(lengths):
        raise ValueError(f"{len(items)} items but {len(lengths)} lengths")
    order = sorted(range(len(items)), key=lambda j: lengths[j])
    alone = [[items[j]] for j in order if lengths[j] > budget]
    fit = [j for j in order if lengths[j] <= budget]
    if not padded:
        rows = pack_rows([lengths[j] for j in fit], budget)
        return [[items[fit[r]] for r in row] for row in rows] + alone
    groups: list[list[T]] = []
    current: list[int] = []
    for j in fit:  # ascending, so j is the longest of its group so far
        if current and (len(current) + 1) * lengths[j] > budget:
            groups.append([items[k] for k in current])
            current = []
        current.append(j)
    if current:
        groups.append([items[k] for k in current])
    return groups + alone
