"""Outcome advantage estimators for group-sampled rollouts (GRPO, RLOO).

An agent trajectory gets one scalar reward at the end; the critic-free estimators here turn
the rewards of the ``n`` samples drawn for the same prompt (a *group*) into a baseline, so the
advantage says "better or worse than this prompt's other attempts". Inputs are one scalar per
trajectory, ``rewards: Float[N]``, and the prompt each came from, ``group_ids``: a
``Long[N]`` tensor or a sequence of hashable ids (e.g. prompt uids). Groups may be of unequal
size (failed rollouts dropped) and interleaved in any order.

A group whose rewards are all equal (every attempt solved, or every attempt failed) carries no
signal: its advantages are exactly 0, and its trajectories only cost compute and dilute
token-mean losses. Estimators count such groups (a key training metric: it rises as the task
saturates) and, with ``drop_zero_spread=True``, mark them in ``keep`` so the caller can drop
them (DAPO's dynamic sampling). Single-sample groups are zero-spread by this definition.

An episode's reward says whether it solved the maze, not how directly: with
:func:`turn_discounted_rewards` a solve counts for less the more turns it took, so a group
in which every sample solved still ranks its samples (the shorter ones took fewer wrong
turns) instead of having zero spread.

The functions here take plain tensors and keywords; each is registered under SkyRL's
``trainer.algorithm.advantage_estimator`` name through a thin adapter with the registry's
uniform signature (``clew.algorithms.estimators``).
"""

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from clew.algorithms.estimators import (
    AdvantageResult,
    EstimatorBatch,
    EstimatorSettings,
    GroupIds,
    register_estimator,
    setting,
)
from clew.algorithms.stats import upcast_float


@dataclass(frozen=True)
class Groups:
    """Dense group structure of a batch.

    Attributes:
        index: ``Long[N]`` group of each trajectory, renumbered to ``0..G-1``.
        size: ``Float[G]`` members per group.
        zero_spread: ``Bool[G]`` True where every reward in the group is equal.
    """

    index: Tensor
    size: Tensor
    zero_spread: Tensor

    @property
    def num_groups(self) -> int:
        return int(self.size.shape[0])

    def sum(self, values: Tensor) -> Tensor:
        """Per-group sum of ``values: Float[N]`` -> ``Float[G]``."""
        out = torch.zeros(self.num_groups, dtype=values.dtype, device=values.device)
        return out.index_add_(0, self.index, values)


def group_rewards(rewards: Tensor, group_ids: GroupIds) -> Groups:
    """Renumber ``group_ids`` densely and find each group's size and zero-spread flag.

    ``rewards: Float[N]``; ``group_ids``: ``Long[N]`` (any integer dtype) or a length-``N``
    sequence of hashables. Zero spread is exact equality (max == min), not a tolerance.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if isinstance(group_ids, Tensor):
        if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
            raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
        if group_ids.shape != (n,):
            raise ValueError(
                f"group_ids shape {tuple(group_ids.shape)} does not match rewards [{n}]"
            )
        _, index = torch.unique(group_ids.to(rewards.device), return_inverse=True)
    else:
        if len(group_ids) != n:
            raise ValueError(f"got {len(group_ids)} group ids for {n} rewards")
        dense: dict[Hashable, int] = {}
        ids = [dense.setdefault(g, len(dense)) for g in group_ids]
        index = torch.tensor(ids, dtype=torch.long, device=rewards.device)
    index = index.long()
    num_groups = int(index.max()) + 1 if n else 0

    r = upcast_float(rewards)
    size = torch.zeros(num_groups, dtype=r.dtype, device=r.device)
    size.index_add_(0, index, torch.ones_like(r))
    hi = torch.full((num_groups,), -torch.inf, dtype=r.dtype, device=r.device)
    lo = torch.full((num_groups,), torch.inf, dtype=r.dtype, device=r.device)
    hi = hi.scatter_reduce(0, index, r, reduce="amax", include_self=True)
    lo = lo.scatter_reduce(0, index, r, reduce="amin", include_self=True)
    return Groups(index=index, size=size, zero_spread=hi == lo)


def turn_discounted_rewards(rewards: Tensor, turns: Tensor, discount: float) -> Tensor:
    """Each episode's reward times ``discount ** (turns - 1)`` (a one-turn episode keeps it).

    ``rewards: Float[N]``, ``turns``: ``Long[N]`` (or float) turns each episode took, each at
    least 1; ``discount`` in (0, 1], where 1 returns ``rewards`` unchanged. A sparse 0/1
    reward becomes the discounted return of the episode's first turn, as in the discounted
    returns of ``step_advantages``; failures stay 0, so failing sooner earns nothing.
    """
    if not 0.0 < discount <= 1.0:
        raise ValueError(f"discount must be in (0, 1], got {discount}")
    if rewards.dim() != 1 or turns.shape != rewards.shape:
        raise ValueError(
            f"rewards [N] and turns [N] must match, got {tuple(rewards.shape)} and "
            f"{tuple(turns.shape)}"
        )
    if discount == 1.0:
        return rewards
    if len(turns) and int(turns.min()) < 1:
        raise ValueError(f"every episode takes at least one turn, got {int(turns.min())}")
    r = upcast_float(rewards)
    return r * torch.pow(torch.tensor(discount, dtype=r.dtype), turns.to(r.dtype) - 1.0)


def _result(advantages: Tensor, groups: Groups, drop_zero_spread: bool) -> AdvantageResult:
    member_zero = groups.zero_spread[groups.index]
    advantages = torch.where(member_zero, 0.0, advantages)
    keep = ~member_zero if drop_zero_spread else torch.ones_like(member_zero)
    return AdvantageResult(
        advantages=advantages,
        keep=keep,
        num_groups=groups.num_groups,
        zero_spread_groups=int(groups.zero_spread.sum()),
    )


def grpo_advantages(
    rewards: Tensor,
    group_ids: GroupIds,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    drop_zero_spread: bool = False,
) -> AdvantageResult:
    """Group-relative advantages: ``A_i = (r_i - mean(group)) / (std(group) + epsilon)``.

    ``std`` is the sample standard deviation (Bessel-corrected, ``n - 1``), as in SkyRL and
    verl. With ``norm_adv_by_std_in_grpo=False`` the division is skipped (Dr. GRPO: dividing by
    the std up-weights near-saturated prompts). Zero-spread groups, including single-sample
    groups, get exactly 0.

    Args:
        rewards: ``Float[N]`` one scalar per trajectory.
        group_ids: ``Long[N]`` or length-``N`` sequence of hashables naming each prompt.
        norm_adv_by_std_in_grpo: divide by the group std.
        epsilon: added to the std before dividing.
        drop_zero_spread: set ``keep`` False for members of zero-spread groups.

    Returns:
        :class:`AdvantageResult` with ``advantages: Float[N]``.
    """
    groups = group_rewards(rewards, group_ids)
    r = upcast_float(rewards)
    mean = groups.sum(r) / groups.size.clamp_min(1.0)
    centered = r - mean[groups.index]
    if norm_adv_by_std_in_grpo:
        var = groups.sum(centered.square()) / (groups.size - 1.0).clamp_min(1.0)
        centered = centered / (var.sqrt()[groups.index] + epsilon)
    return _result(centered, groups, drop_zero_spread)


def rloo_advantages(
    rewards: Tensor,
    group_ids: GroupIds,
    *,
    drop_zero_spread: bool = False,
) -> AdvantageResult:
    """REINFORCE leave-one-out: ``A_i = r_i - mean(r_j for j != i in the group)``.

    The baseline excludes the sample itself, so it is independent of ``r_i`` and the
    estimate is unbiased. Equivalent to ``n / (n - 1) * (r_i - mean(group))``. Zero-spread
    groups, including single-sample groups (no other sample to compare with), get exactly 0.

    Args:
        rewards: ``Float[N]``; group_ids: ``Long[N]`` or sequence of hashables.
        drop_zero_spread: set ``keep`` False for members of zero-spread groups.
    """
    groups = group_rewards(rewards, group_ids)
    r = upcast_float(rewards)
    total = groups.sum(r)[groups.index]
    others = (groups.size[groups.index] - 1.0).clamp_min(1.0)
    return _result(r - (total - r) / others, groups, drop_zero_spread)


@register_estimator("grpo", min_group_size=2)
def _grpo(batch: EstimatorBatch, settings: EstimatorSettings) -> AdvantageResult:
    return grpo_advantages(
        batch.rewards,
        batch.group_ids,
        norm_adv_by_std_in_grpo=setting(settings, "norm_adv_by_std_in_grpo", True),
        drop_zero_spread=setting(settings, "drop_zero_spread_groups", False),
    )


@register_estimator("rloo", min_group_size=2)
def _rloo(batch: EstimatorBatch, settings: EstimatorSettings) -> AdvantageResult:
    return rloo_advantages(
        batch.rewards,
        batch.group_ids,
        drop_zero_spread=setting(settings, "drop_zero_spread_groups", False),
    )


def token_advantages(adv: Tensor, loss_mask: Tensor) -> Tensor:
    """Broadcast per-trajectory advantages onto tokens: ``adv[:, None] * loss_mask``.

    ``adv: Float[N]``, ``loss_mask: Float[N, T]`` (or bool) -> ``Float[N, T]``, 0 off the mask.
    Every trained token of a trajectory shares its outcome advantage.
    """
    if adv.dim() != 1 or loss_mask.dim() != 2 or loss_mask.shape[0] != adv.shape[0]:
        raise ValueError(
            f"expected adv [N] and loss_mask [N, T], got {tuple(adv.shape)} and "
            f"{tuple(loss_mask.shape)}"
        )
    return adv[:, None] * loss_mask.to(adv.dtype)
