"""The 'pass_at_k' estimator against its paper's definition, derived here by enumeration.

Chen et al. 2025 (https://arxiv.org/abs/2508.10751) score every k-subset of a group by its
best member, normalise the subset scores by their mean and (population) std, and give each
sample the mean normalised score of the subsets that contain it; the estimator's closed form
must equal that, subset by subset.
"""

from __future__ import annotations

import itertools
import math
import re
import statistics

import pytest
import torch

from clew.algorithms import (
    EstimatorBatch,
    compute_advantages,
    get_estimator,
    pass_at_k_advantages,
)
from clew.config import load_config
from clew.errors import ConfigError

CPU_DEMO = "recipes/cpu-demo.yaml"
EPS = 1e-6


def brute_force(rewards: list[float], k: int, norm: bool = True) -> tuple[list[float], float]:
    """Each sample's advantage and the group's pass@k, by enumerating every k-subset."""
    subsets = list(itertools.combinations(range(len(rewards)), k))
    score = {s: max(rewards[i] for i in s) for s in subsets}
    mean = statistics.fmean(score.values())
    std = statistics.pstdev(score.values())
    if std == 0:  # every subset scores the same: nothing to learn from
        return [0.0] * len(rewards), mean
    scale = std + EPS if norm else 1.0
    adv = [
        statistics.fmean((score[s] - mean) / scale for s in subsets if i in s)
        for i in range(len(rewards))
    ]
    return adv, mean


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0
    )


GROUPS = [
    [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # one solve in eight
    [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 1.0, 0.0, 1.0, 1.0, 0.0],
    [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 1.0],
]


CASES = [(group, k) for group in GROUPS for k in range(1, 6) if k <= len(group)]


@pytest.mark.parametrize("norm", [True, False], ids=["std", "no-std"])
@pytest.mark.parametrize(
    ("group", "k"), CASES, ids=[f"{''.join(str(int(r)) for r in g)}-k{k}" for g, k in CASES]
)
def test_closed_form_equals_the_mean_over_subsets_holding_each_sample(group, k, norm):
    rewards = torch.tensor(group, dtype=torch.float64)
    res = pass_at_k_advantages(rewards, [0] * len(group), k=k, norm_adv_by_std_in_grpo=norm)
    expected, pass_k = brute_force(group, k, norm)
    close(res.advantages, expected, atol=1e-9)
    # The subsets' mean score is the unbiased pass@k estimate 1 - C(N - c, k) / C(N, k).
    n, c = len(group), int(sum(group))
    assert pass_k == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    assert res.stats["pass_at_k"] == pytest.approx(pass_k)


def test_several_interleaved_groups_of_unequal_size_each_match_the_enumeration():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    ids = ["a", "b", "a", "b", "a", "a", "a", "b", "b", "b", "a"]
    res = pass_at_k_advantages(torch.tensor(rewards), ids, k=3)
    for g in ("a", "b"):
        members = [i for i, x in enumerate(ids) if x == g]
        expected, _ = brute_force([rewards[i] for i in members], 3)
        close(res.advantages[members], expected, atol=1e-5)
    assert res.num_groups == 2 and res.zero_spread_groups == 0


def test_hand_values_of_one_solve_in_four_at_k_2():
    # C(4, 2) = 6 pairs, 3 hold the solve: R = 1/2, sigma = 1/2. The solve's pairs all pass:
    # (1 - 1/2) / (1/2) = 1. A failure's 3 pairs hold the solve once: (1/3 - 1/2) / (1/2).
    batch = EstimatorBatch(torch.tensor([0.0, 1.0, 0.0, 0.0]), [7] * 4)
    res = compute_advantages("pass_at_k", batch, {"pass_at_k": {"k": 2}})
    close(res.advantages, [-1 / 3, 1.0, -1 / 3, -1 / 3], atol=1e-5)
    assert res.stats == {"pass_at_k": 0.5, "pass_at_k_saturated_groups": 0.0}


@pytest.mark.parametrize("norm", [True, False])
def test_k_1_is_grpo_for_binary_rewards(norm):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    ids = torch.tensor([0] * 8 + [1] * 4)
    settings = {"pass_at_k": {"k": 1}, "norm_adv_by_std_in_grpo": norm}
    batch = EstimatorBatch(rewards, ids)
    ours = compute_advantages("pass_at_k", batch, settings).advantages
    grpo = compute_advantages("grpo", batch, settings).advantages
    if norm:
        # GRPO divides by the Bessel-corrected std, the paper by the population one.
        sizes = torch.tensor([8.0] * 8 + [4.0] * 4)
        grpo = grpo * torch.sqrt(sizes / (sizes - 1))
    close(ours, grpo, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_all_pass_and_all_fail_groups_get_exactly_zero(k):
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4 + [1.0, 0.0, 0.0, 0.0])
    ids = [0] * 4 + [1] * 4 + [2] * 4
    res = pass_at_k_advantages(rewards, ids, k=k, drop_zero_spread=True)
    assert torch.isfinite(res.advantages).all()
    assert res.advantages[:8].tolist() == [0.0] * 8
    assert res.advantages[8:].abs().min() > 0
    assert res.zero_spread_groups == 2
    assert res.keep.tolist() == [False] * 8 + [True] * 4


def test_a_group_with_fewer_than_k_failures_is_saturated_and_gets_zero():
    # Three solves in four at k = 2: every pair holds a solve, pass@2 is 1 whatever the
    # policy does, so no sample is pushed either way; the group has reward spread, though.
    res = pass_at_k_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), [0] * 4, k=2)
    assert res.advantages.tolist() == [0.0] * 4
    assert res.zero_spread_groups == 0 and res.stats["pass_at_k_saturated_groups"] == 1.0
    # k = N: one subset per group, nothing to compare it with.
    res = pass_at_k_advantages(torch.tensor([1.0, 0.0, 0.0]), [0] * 3, k=3)
    assert res.advantages.tolist() == [0.0] * 3


def test_a_group_smaller_than_k_gets_zero_and_an_empty_batch_is_fine():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    res = pass_at_k_advantages(rewards, [0, 0, 1, 1, 1, 1], k=3)
    assert res.advantages[:2].tolist() == [0.0, 0.0] and res.advantages[2:].abs().min() > 0
    empty = pass_at_k_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), k=2)
    assert empty.advantages.shape == (0,) and empty.num_groups == 0


@pytest.mark.parametrize("reward", [0.95, 0.2, -1.0, float("nan")])
def test_non_binary_rewards_are_refused_naming_the_settings(reward):
    with pytest.raises(ValueError, match=r"'pass_at_k' needs binary rewards.*turn_discount"):
        pass_at_k_advantages(torch.tensor([1.0, reward, 0.0]), [0, 0, 0], k=2)


def test_k_below_one_is_refused():
    with pytest.raises(ValueError, match="k >= 1"):
        pass_at_k_advantages(torch.tensor([1.0, 0.0]), [0, 0], k=0)


def test_registered_with_its_group_size_and_default_k():
    spec = get_estimator("pass_at_k")
    assert spec.min_group_size == 2 and spec.needs == frozenset()
    rewards = torch.tensor([1.0] + [0.0] * 7)
    default = compute_advantages("pass_at_k", EstimatorBatch(rewards, [0] * 8))
    close(default.advantages, brute_force(rewards.tolist(), 4)[0], atol=1e-5)


# ---------------------------------------------------------------- configuration


def test_the_cpu_demo_loads_with_the_estimator_and_hands_it_k():
    overrides = [
        "trainer.algorithm.advantage_estimator=pass_at_k",
        "trainer.algorithm.pass_at_k.k=3",
    ]
    cfg = load_config(CPU_DEMO, overrides)
    alg = cfg.trainer.algorithm
    assert (alg.advantage_estimator, alg.pass_at_k.k) == ("pass_at_k", 3)
    assert cfg.generator.n_samples_per_prompt == 8
    # The trainer hands the estimator the section as a mapping (clew.trainer.grpo).
    rewards = torch.tensor([0.0, 1.0] + [0.0] * 6)
    res = compute_advantages("pass_at_k", EstimatorBatch(rewards, [0] * 8), alg.model_dump())
    close(res.advantages, brute_force(rewards.tolist(), 3)[0], atol=1e-5)
    assert load_config(CPU_DEMO, overrides[:1]).trainer.algorithm.pass_at_k.k == 4


@pytest.mark.parametrize("k", [0, 8, 9])
def test_a_k_outside_one_to_the_group_size_less_one_is_refused(k):
    overrides = [
        "trainer.algorithm.advantage_estimator=pass_at_k",
        f"trainer.algorithm.pass_at_k.k={k}",
    ]
    with pytest.raises(ConfigError) as err:
        load_config(CPU_DEMO, overrides)
    message = str(err.value)
    assert (
        "[pass-at-k] trainer.algorithm.pass_at_k.k must be in "
        f"[1, generator.n_samples_per_prompt - 1] = [1, 7] for advantage_estimator 'pass_at_k', "
        f"got {k}"
    ) in message
    assert ("a group is one k-subset" in message) == (k == 8)


def test_k_is_not_checked_for_the_other_estimators():
    cfg = load_config(CPU_DEMO, ["trainer.algorithm.pass_at_k.k=99"])
    assert cfg.trainer.algorithm.advantage_estimator == "grpo"


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("trainer.algorithm.turn_discount=0.95", "turn_discount (0.95) makes a solve worth less"),
        ("environment.reward_rule=skyrl_visgym", "reward_rule 'skyrl_visgym' pays partial credit"),
    ],
)
def test_non_binary_reward_settings_are_refused_with_the_estimator(override, needle):
    with pytest.raises(ConfigError, match=r"\[pass-at-k\].*" + re.escape(needle)):
        load_config(CPU_DEMO, ["trainer.algorithm.advantage_estimator=pass_at_k", override])
