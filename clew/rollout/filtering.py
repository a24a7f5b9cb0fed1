"""DAPO's dynamic sampling (``trainer.algorithm.dynamic_sampling.type=filter``).

A GRPO group whose samples all got the same reward has zero advantage: it costs a full
share of the update and teaches nothing. With the filter on, the trainer plays more
batches of prompts until ``train_batch_size`` groups with reward spread are in hand (or
``max_sample_batches`` batches were played) and updates on those only. These are the
pure pieces: which groups carry signal, and the batch made of the first ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from clew.algorithms.advantages import group_rewards
from clew.rollout.trajectory import Trajectory


def spread_groups(trajs: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """The groups of ``trajs`` (in first-seen order) whose rewards are not all equal."""
    if not trajs:
        return []
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    ids = torch.tensor([t.group_id for t in trajs])
    groups = group_rewards(rewards, ids)
    has_spread = (~groups.zero_spread)[groups.index].tolist()
    out: dict[int, list[Trajectory]] = {}
    for t, keep in zip(trajs, has_spread, strict=True):
        if keep:
            out.setdefault(t.group_id, []).append(t)
    return list(out.values())


def take_groups(groups: Sequence[Sequence[Trajectory]], count: int) -> list[Trajectory]:
    """The first ``count`` groups as one batch, group ids renumbered ``0..`` (batches sampled
    separately reuse ids), in (group, sample) order."""
    batch: list[Trajectory] = []
    for new_id, group in enumerate(groups[:count]):
        for t in sorted(group, key=lambda t: t.sample_index):
            t.group_id = new_id
            batch.append(t)
    return batch
