"""DAPO's dynamic sampling (``trainer.algorithm.dynamic_sampling.type=filter``).

A GRPO group whose samples all got the same reward has zero advantage: it costs a full
share of the update and teaches nothing. With the filter on, the trainer plays more
batches of prompts until ``train_batch_size`` groups with reward spread are in hand (or
``max_sample_batches`` batches were played) and updates on those only. These are the
pure pieces: the rewards a group is judged by (the env's, after
``trainer.algorithm.turn_discount``: the update's own, so both agree on what has spread),
which groups carry signal, the batch made of the first ones, and how many
batches of prompts that took (the trainer plays that many at once the next step: on a
host-bound engine one play of k batches costs far less than k plays).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from clew.algorithms.advantages import group_rewards, turn_discounted_rewards
from clew.rollout.trajectory import Trajectory


def spread_groups(
    trajs: Sequence[Trajectory], turn_discount: float = 1.0
) -> list[list[Trajectory]]:
    """The groups of ``trajs`` (in first-seen order) whose rewards are not all equal, after
    ``turn_discount`` (``trainer.algorithm.turn_discount``) as the update will see them."""
    if not trajs:
        return []
    rewards = learning_rewards(trajs, turn_discount)
    ids = torch.tensor([t.group_id for t in trajs])
    groups = group_rewards(rewards, ids)
    has_spread = (~groups.zero_spread)[groups.index].tolist()
    out: dict[int, list[Trajectory]] = {}
    for t, keep in zip(trajs, has_spread, strict=True):
        if keep:
            out.setdefault(t.group_id, []).append(t)
    return list(out.values())


def learning_rewards(trajs: Sequence[Trajectory], turn_discount: float = 1.0) -> torch.Tensor:
    """``Float[N]``: the rewards an update learns from, the env's discounted by turns."""
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    # An episode that failed before its first turn (an env error at reset) has reward 0
    # whatever its discount: counted as one turn rather than refused.
    turns = torch.tensor([max(t.turns, 1) for t in trajs])
    return turn_discounted_rewards(rewards, turns, turn_discount)


def take_groups(groups: Sequence[Sequence[Trajectory]], count: int) -> list[Trajectory]:
    """The first ``count`` groups as one batch, group ids renumbered ``0..`` (batches sampled
    separately reuse ids), in (group, sample) order."""
    batch: list[Trajectory] = []
    for new_id, group in enumerate(groups[:count]):
        for t in sorted(group, key=lambda t: t.sample_index):
            t.group_id = new_id
            batch.append(t)
    return batch


def spread_per_batch(
    groups: Sequence[Sequence[Trajectory]], batches: int, batch_size: int
) -> list[int]:
    """How many of ``groups`` (spread groups of one play of ``batches`` batches of
    ``batch_size`` prompts, group id = prompt index) came from each batch."""
    counts = [0] * batches
    for group in groups:
        counts[min(group[0].group_id // batch_size, batches - 1)] += 1
    return counts


def batches_needed(counts: Sequence[int], want: int) -> int:
    """The fewest leading batches whose spread-group ``counts`` add up to ``want`` (all of
    them if they never do)."""
    total = 0
    for i, count in enumerate(counts, 1):
        total += count
        if total >= want:
            return i
    return max(len(counts), 1)
