"""Pass@k training's analytical group advantage (Chen et al. 2025, arXiv 2508.10751).

GRPO rewards each sample on its own (pass@1): a prompt the policy solves one time in eight
pushes it toward that one solve and away from the seven other attempts, whatever they tried.
Pass@k training rewards a *set* of ``k`` samples by its best member, so an attempt that failed
is pushed down only as much as the sets it belongs to fail, and exploring stays cheap. Chen et
al. ("Pass@k Training for Adaptively Balancing Exploration and Exploitation of Large Reasoning
Models", https://arxiv.org/abs/2508.10751, section "analytical derivation"; the authors'
``code/passk_adv.py`` at https://github.com/RUCAIBox/Passk_Training) take every ``k``-subset
of a group of ``N`` samples, give it the reward ``max`` of its members' (binary) rewards,
normalise those subset rewards GRPO's way, and give each sample the mean normalised reward of
the subsets that contain it. With ``c`` of the ``N`` samples passing, that is, in closed form::

    R     = 1 - C(N - c, k) / C(N, k)             the subsets' mean reward (pass@k estimate)
    sigma = sqrt(R * (1 - R))                     the subsets' reward std (population)
    A_pos = (1 - R) / sigma
    A_neg = (1 - R - C(N - c - 1, k - 1) / C(N - 1, k - 1)) / sigma

``tests/algorithms/test_pass_at_k.py`` derives the same numbers by enumerating the subsets.
At ``k = 1`` the subsets are the samples: ``A = (r - mean) / std``, GRPO's advantage except
that the std is the population one (GRPO's is Bessel-corrected, so GRPO's advantages are
``sqrt((N - 1) / N)`` times these); without the std division the two agree exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from clew.algorithms.advantages import group_rewards
from clew.algorithms.estimators import (
    AdvantageResult,
    EstimatorBatch,
    EstimatorSettings,
    GroupIds,
    register_estimator,
    setting,
)
from clew.algorithms.stats import upcast_float


def _group_terms(n: int, c: int, k: int) -> tuple[float, float, float, float]:
    """``(R, sigma, A_pos numerator, A_neg numerator)`` of a group of ``n`` with ``c`` passes,
    from exact integer binomials (no rounding before the one division each)."""
    if n < k:  # no k-subset at all: no pass@k to estimate
        return 0.0, 0.0, 0.0, 0.0
    fail_all = math.comb(n - c, k) / math.comb(n, k)  # share of subsets with no pass
    r = 1.0 - fail_all
    # Share of the subsets holding a given failed sample that hold no pass.
    neg_fail = math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1) if c < n else 0.0
    return r, math.sqrt(fail_all * r), fail_all, fail_all - neg_fail


def pass_at_k_advantages(
    rewards: Tensor,
    group_ids: GroupIds,
    *,
    k: int,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    drop_zero_spread: bool = False,
) -> AdvantageResult:
    """Pass@k training's analytical advantages (see the module docstring for the formulas).

    Rewards must be binary, 0 (fail) or 1 (pass), as the paper's are: any other value raises
    ``ValueError`` rather than being rounded to a pass or a fail (under clew's
    ``turn_discount`` or the ``skyrl_visgym`` rule's format credit, "reward > 0" would count
    a discounted solve, or a well-formed failure, as a full pass without saying so).

    A group carries no signal, and gets exactly 0, when every ``k``-subset scores the same:
    all samples pass, all fail, fewer than ``k`` fail (every subset holds a pass: pass@k is
    saturated, ``stats["pass_at_k_saturated_groups"]`` counts these groups), or the group
    has ``k`` samples or fewer (one subset or none, e.g. after failed rollouts were dropped).
    ``k = 1`` and ``k = N`` are the two ends: GRPO with a population std, and no signal at all.

    Args:
        rewards: ``Float[N]`` one reward per trajectory, each 0.0 or 1.0.
        group_ids: ``Long[N]`` or length-``N`` sequence of hashables naming each prompt.
        k: the subset size, >= 1.
        norm_adv_by_std_in_grpo: divide by the subsets' reward std (the paper does);
            without, each advantage is the mean centred pass@k reward of its subsets.
        epsilon: added to the std before dividing (as the authors' code and ``grpo`` do).
        drop_zero_spread: set ``keep`` False for members of groups whose rewards are all
            equal (``zero_spread_groups``, as in ``grpo``; saturated groups are kept).

    Returns:
        :class:`AdvantageResult`; ``stats`` holds ``pass_at_k`` (the groups' mean ``R``, the
        unbiased pass@k estimate of the batch) and ``pass_at_k_saturated_groups``.
    """
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got {k}")
    groups = group_rewards(rewards, group_ids)
    r = upcast_float(rewards)
    passed = r == 1.0
    if bad := sorted({float(v) for v in r[~passed & (r != 0.0)].tolist()}):
        shown = ", ".join(f"{v:g}" for v in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise ValueError(
            "trainer.algorithm.advantage_estimator 'pass_at_k' needs binary rewards, 0 (fail) "
            f"or 1 (pass); got {shown}. Keep trainer.algorithm.turn_discount at 1 and "
            "environment.reward_rule at 'task' with an env that pays 0 or 1, or use 'grpo'"
        )
    sizes = groups.size.long().tolist()
    passes = groups.sum(passed.to(r.dtype)).long().tolist()
    terms = [_group_terms(n, c, k) for n, c in zip(sizes, passes, strict=True)]
    per_group = torch.tensor(terms, dtype=torch.float64, device=r.device).reshape(-1, 4)
    mean, sigma, pos, neg = per_group.unbind(-1)
    if norm_adv_by_std_in_grpo:
        signal = sigma > 0
        scale = torch.where(signal, sigma + epsilon, 1.0)
        pos, neg = torch.where(signal, pos / scale, 0.0), torch.where(signal, neg / scale, 0.0)
    adv = torch.where(passed, pos[groups.index], neg[groups.index]).to(r.dtype)
    member_zero = groups.zero_spread[groups.index]
    saturated = sum(1 for n, c in zip(sizes, passes, strict=True) if 0 < n - c < k <= n)
    return AdvantageResult(
        advantages=torch.where(member_zero, 0.0, adv),
        keep=~member_zero if drop_zero_spread else torch.ones_like(member_zero),
        num_groups=groups.num_groups,
        zero_spread_groups=int(groups.zero_spread.sum()),
        stats={
            "pass_at_k": float(mean.mean()) if groups.num_groups else 0.0,
            "pass_at_k_saturated_groups": float(saturated),
        },
    )


@register_estimator("pass_at_k", min_group_size=2)
def _pass_at_k(batch: EstimatorBatch, settings: EstimatorSettings) -> AdvantageResult:
    return pass_at_k_advantages(
        batch.rewards,
        batch.group_ids,
        k=setting(settings, "pass_at_k.k", 4),
        norm_adv_by_std_in_grpo=setting(settings, "norm_adv_by_std_in_grpo", True),
        drop_zero_spread=setting(settings, "drop_zero_spread_groups", False),
    )
