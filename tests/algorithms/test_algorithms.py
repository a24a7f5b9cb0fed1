"""Hand-computed checks of clew.algorithms: advantages, losses, KL, token statistics."""

import math

import pytest
import torch

from clew.algorithms import (
    ADVANTAGE_ESTIMATORS,
    LOG_RATIO_CLAMP,
    EstimatorBatch,
    compute_advantages,
    compute_policy_loss,
    entropy_from_logits,
    get_estimator,
    get_kl_estimator,
    get_policy_loss,
    grpo_advantages,
    kl_loss,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    ppo_clip_loss,
    reduce_loss,
    register_estimator,
    rloo_advantages,
    setting,
    token_advantages,
    turn_discounted_rewards,
)

EPS = 1e-6


def t(*rows):
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=torch.float32)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0
    )


# ---------------------------------------------------------------- advantages


def test_grpo_two_groups_normalised_by_sample_std():
    # Interleaved groups: 0 -> rewards [0, 1, 2] (mean 1, sample std 1),
    #                     1 -> rewards [10, 20, 30] (mean 20, sample std 10).
    rewards = t([0.0, 10.0, 1.0, 20.0, 2.0, 30.0])
    ids = torch.tensor([0, 1, 0, 1, 0, 1])
    res = grpo_advantages(rewards, ids)
    s0, s1 = 1 / (1 + EPS), 10 / (10 + EPS)
    close(res.advantages, [-s0, -s1, 0.0, 0.0, s0, s1])
    assert res.num_groups == 2 and res.zero_spread_groups == 0
    assert res.keep.all()


def test_grpo_without_std_normalisation_is_mean_centred():
    rewards = t([0.0, 10.0, 1.0, 20.0, 2.0, 30.0])
    ids = torch.tensor([0, 1, 0, 1, 0, 1])
    res = grpo_advantages(rewards, ids, norm_adv_by_std_in_grpo=False)
    close(res.advantages, [-1.0, -10.0, 0.0, 0.0, 1.0, 10.0])


def test_grpo_zero_spread_group_gets_zero_advantage_is_counted_and_dropped_on_request():
    rewards = t([1.0, 1.0, 0.0, 1.0, 2.0])
    ids = torch.tensor([0, 0, 1, 1, 1])
    res = grpo_advantages(rewards, ids)
    close(res.advantages, [0.0, 0.0, -1 / (1 + EPS), 0.0, 1 / (1 + EPS)])
    assert res.advantages[:2].eq(0).all()  # exactly zero, not epsilon-small
    assert (res.num_groups, res.zero_spread_groups) == (2, 1)
    assert res.keep.tolist() == [True] * 5
    dropped = grpo_advantages(rewards, ids, drop_zero_spread=True)
    assert dropped.keep.tolist() == [False, False, True, True, True]
    assert dropped.keep.dtype == torch.bool


def test_grpo_unequal_non_contiguous_groups_with_arbitrary_ids():
    # group 5: rewards [1, 3] -> mean 2, sample std sqrt(2)
    # group 2: rewards [0, 3, 6] -> mean 3, sample std 3
    rewards = t([1.0, 0.0, 3.0, 3.0, 6.0])
    ids = torch.tensor([5, 2, 5, 2, 2])
    raw = grpo_advantages(rewards, ids, norm_adv_by_std_in_grpo=False)
    close(raw.advantages, [-1.0, -3.0, 1.0, 0.0, 3.0])
    res = grpo_advantages(rewards, ids)
    a, b = 1 / (math.sqrt(2) + EPS), 3 / (3 + EPS)
    close(res.advantages, [-a, -b, a, 0.0, b])
    # hashable ids (prompt uids) give the same answer as integer ids
    by_uid = grpo_advantages(rewards, ["p5", "p2", "p5", "p2", "p2"])
    close(by_uid.advantages, res.advantages)
    assert res.num_groups == 2


def test_singleton_group_is_zero_spread():
    res = grpo_advantages(t([3.0, 0.0, 1.0]), torch.tensor([9, 1, 1]), drop_zero_spread=True)
    # group 1: [0, 1] -> mean 0.5, sample std sqrt(0.5); group 9: one sample, zero spread
    a = 0.5 / (math.sqrt(0.5) + EPS)
    close(res.advantages, [0.0, -a, a])
    assert res.zero_spread_groups == 1 and res.keep.tolist() == [False, True, True]


def test_turn_discount_by_hand_ranks_shorter_solves_in_a_group_that_all_solved():
    rewards, turns = t(1.0, 1.0, 0.0, 1.0), torch.tensor([1, 3, 5, 11])
    close(turn_discounted_rewards(rewards, turns, 0.9), [1.0, 0.81, 0.0, 0.9**10], atol=1e-6)
    assert turn_discounted_rewards(rewards, turns, 1.0) is rewards
    # Every sample solved: plain GRPO sees no spread, the discounted rewards do.
    group = [0, 0, 0]
    solved, taken = t(1.0, 1.0, 1.0), torch.tensor([13, 13, 17])
    assert grpo_advantages(solved, group).zero_spread_groups == 1
    adv = grpo_advantages(turn_discounted_rewards(solved, taken, 0.97), group)
    assert adv.zero_spread_groups == 0
    assert adv.advantages[0] == adv.advantages[1] > 0 > adv.advantages[2]


@pytest.mark.parametrize("discount", [0.0, -0.5, 1.5])
def test_turn_discount_outside_zero_one_is_rejected(discount):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        turn_discounted_rewards(t(1.0, 0.0), torch.tensor([2, 3]), discount)


def test_turn_discount_needs_one_turn_count_per_reward_of_at_least_one():
    with pytest.raises(ValueError, match="must match"):
        turn_discounted_rewards(t(1.0, 0.0), torch.tensor([2]), 0.9)
    with pytest.raises(ValueError, match="at least one turn"):
        turn_discounted_rewards(t(1.0, 0.0), torch.tensor([0, 3]), 0.9)


def test_rloo_leave_one_out_by_hand():
    # group 0: [1, 2, 6] -> 1-(2+6)/2=-3, 2-(1+6)/2=-1.5, 6-(1+2)/2=4.5
    # group 1: [0, 4]    -> 0-4=-4, 4-0=4 ; group 2: [5, 5] zero spread
    rewards = t([1.0, 0.0, 2.0, 5.0, 6.0, 4.0, 5.0])
    ids = torch.tensor([0, 1, 0, 2, 0, 1, 2])
    res = rloo_advantages(rewards, ids, drop_zero_spread=True)
    close(res.advantages, [-3.0, -4.0, -1.5, 0.0, 4.5, 4.0, 0.0])
    assert (res.num_groups, res.zero_spread_groups) == (3, 1)
    assert res.keep.tolist() == [True, True, True, False, True, True, False]


def test_compute_advantages_dispatches_by_name_and_passes_settings():
    batch = EstimatorBatch(t([0.0, 2.0, 5.0, 5.0]), torch.tensor([0, 0, 1, 1]))
    raw = compute_advantages("grpo", batch, {"norm_adv_by_std_in_grpo": False})
    close(raw.advantages, [-1.0, 1.0, 0.0, 0.0])
    close(compute_advantages("rloo", batch).advantages, [-2.0, 2.0, 0.0, 0.0])
    dropped = compute_advantages("rloo", batch, {"drop_zero_spread_groups": True})
    assert dropped.keep.tolist() == [True, True, False, False]


def test_an_estimator_missing_what_its_spec_needs_is_refused():
    assert get_estimator("gigpo").needs == {"turn_rewards", "state_keys"}
    assert get_estimator("grpo").needs == frozenset()
    batch = EstimatorBatch(t([0.0, 1.0]), [0, 0], turn_rewards=[t([0.0]), t([1.0])])
    with pytest.raises(ValueError, match=r"'gigpo' needs \['state_keys'\]"):
        compute_advantages("gigpo", batch)


def test_setting_reads_dotted_keys_with_a_default():
    settings = {"gigpo": {"gamma": 0.5}, "norm_adv_by_std_in_grpo": False}
    assert setting(settings, "gigpo.gamma", 0.9) == 0.5
    assert setting(settings, "gigpo.step_advantage_w", 1.0) == 1.0
    assert setting(settings, "norm_adv_by_std_in_grpo", True) is False
    assert setting({}, "gigpo.gamma", 0.9) == 0.9


def test_empty_batch_has_no_groups():
    res = grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert res.advantages.shape == (0,) and res.num_groups == 0 and res.zero_spread_groups == 0


def test_token_advantages_broadcast_over_masked_tokens():
    out = token_advantages(t([2.0, -1.0]), t([1.0, 1.0, 0.0], [0.0, 1.0, 1.0]))
    close(out, [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]])


def test_register_estimator_adds_a_name_with_its_needs():
    @register_estimator("_test_const", needs={"turn_rewards"}, min_group_size=3)
    def const(batch, settings):
        return grpo_advantages(batch.rewards * 0, batch.group_ids)

    try:
        spec = get_estimator("_test_const")
        assert (spec.fn, spec.needs, spec.min_group_size) == (const, {"turn_rewards"}, 3)
        with pytest.raises(ValueError, match="already registered"):
            register_estimator("_test_const")(const)
    finally:
        ADVANTAGE_ESTIMATORS.pop("_test_const")
    with pytest.raises(ValueError, match="'values'.*accepted: 'state_keys', 'turn_rewards'"):
        register_estimator("_test_critic", needs={"values"})


# ---------------------------------------------------------------- reductions and losses

VALUES = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
MASK = t([1.0, 1.0, 0.0], [1.0, 0.0, 0.0])


def test_reduce_token_mean():
    close(reduce_loss(VALUES, MASK, "token_mean"), (1 + 2 + 4) / 3)


def test_reduce_sequence_mean():
    close(reduce_loss(VALUES, MASK, "sequence_mean"), ((1 + 2) / 2 + 4 / 1) / 2)


def test_reduce_seq_mean_token_sum_norm_divides_by_constant_length():
    close(reduce_loss(VALUES, MASK, "seq_mean_token_sum_norm", max_seq_len=4), (3 / 4 + 4 / 4) / 2)
    with pytest.raises(ValueError, match="max_seq_len"):
        reduce_loss(VALUES, MASK, "seq_mean_token_sum_norm")


def test_reductions_ignore_non_finite_values_off_the_mask():
    values = t([1.0, float("nan")], [float("inf"), 3.0])
    mask = t([1.0, 0.0], [0.0, 1.0])
    close(reduce_loss(values, mask, "token_mean"), 2.0)
    close(reduce_loss(values, mask, "sequence_mean"), 2.0)


def test_ppo_clip_at_ratio_one_is_minus_advantage_under_each_reduction():
    adv = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    lp = torch.zeros(2, 3)
    for reduction, expected in [("token_mean", -7 / 3), ("sequence_mean", -2.75)]:
        loss, stats = ppo_clip_loss(lp, lp, adv, MASK, reduction=reduction)
        close(loss, expected)
        assert float(stats["clip_fraction"]) == 0.0 and float(stats["ratio_mean"]) == 1.0
        assert float(stats["approx_kl"]) == 0.0
    loss, _ = ppo_clip_loss(lp, lp, adv, MASK, reduction="seq_mean_token_sum_norm", max_seq_len=4)
    close(loss, -0.875)


def _clip_case():
    # tokens: (ratio, A): (1.5, +1) clipped; (0.5, -1) clipped; (1.0, +1); (1.5, -1);
    # masked out: (2.0, +1) which would be clipped.
    ratio = t([1.5, 0.5, 2.0], [1.0, 1.5, 1.0])
    adv = t([1.0, -1.0, 1.0], [1.0, -1.0, 0.0])
    mask = t([1.0, 1.0, 0.0], [1.0, 1.0, 0.0])
    old = torch.full((2, 3), -1.0)
    return old + ratio.log(), old, adv, mask


def test_ppo_clip_loss_value_and_clip_fraction():
    lp, old, adv, mask = _clip_case()
    loss, stats = ppo_clip_loss(lp, old, adv, mask)
    # per token: -min(1.5, 1.2) = -1.2; -min(-0.5, -0.8) = 0.8; -1.0; -min(-1.5, -1.2) = 1.5
    close(loss, (-1.2 + 0.8 - 1.0 + 1.5) / 4)
    assert float(stats["clip_fraction"]) == pytest.approx(0.5)
    assert float(stats["ratio_mean"]) == pytest.approx((1.5 + 0.5 + 1.0 + 1.5) / 4)
    assert float(stats["ratio_max"]) == pytest.approx(1.5)
    k3 = lambda r: r - 1 - math.log(r)  # noqa: E731
    assert float(stats["approx_kl"]) == pytest.approx((2 * k3(1.5) + k3(0.5)) / 4, abs=1e-6)


def test_ppo_clip_gives_zero_gradient_on_clipped_tokens_only():
    lp, old, adv, mask = _clip_case()
    lp = lp.clone().requires_grad_(True)
    loss, _ = ppo_clip_loss(lp, old, adv, mask)
    loss.backward()
    g = lp.grad
    assert g[0, 0] == 0.0  # ratio 1.5 > 1 + eps_high with A > 0
    assert g[0, 1] == 0.0  # ratio 0.5 < 1 - eps_low with A < 0
    assert g[0, 2] == 0.0  # off the mask
    # unclipped: d(-ratio * A)/d logp / 4 tokens
    close(g[1, 0], -1.0 * 1.0 / 4)
    close(g[1, 1], 1.5 * 1.0 / 4)


def test_ppo_clip_asymmetric_range_uses_eps_clip_high_above():
    old = torch.zeros(1, 1)
    lp = torch.tensor([[math.log(1.25)]])
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    _, low = ppo_clip_loss(lp, old, adv, mask, eps_clip_low=0.2, eps_clip_high=0.2)
    _, high = ppo_clip_loss(lp, old, adv, mask, eps_clip_low=0.2, eps_clip_high=0.28)
    assert (float(low["clip_fraction"]), float(high["clip_fraction"])) == (1.0, 0.0)


def test_dual_clip_bounds_loss_of_negative_advantage_with_huge_ratio():
    old = torch.zeros(1, 1)
    lp = torch.tensor([[math.log(5.0)]], requires_grad=True)
    adv, mask = -torch.ones(1, 1), torch.ones(1, 1)
    plain, _ = ppo_clip_loss(lp, old, adv, mask)
    close(plain.detach(), 5.0)
    loss, stats = ppo_clip_loss(lp, old, adv, mask, clip_ratio_c=3.0)
    close(loss.detach(), 3.0)
    loss.backward()
    assert lp.grad.item() == 0.0 and float(stats["dual_clip_fraction"]) == 1.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_loss(lp, old, adv, mask, clip_ratio_c=0.5)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_step_moves_logprobs_with_advantage_sign(sign):
    old = torch.log(t([0.2, 0.5, 0.3], [0.1, 0.6, 0.3]))
    lp = old.clone().requires_grad_(True)
    mask = t([1.0, 1.0, 1.0], [1.0, 1.0, 0.0])
    adv = token_advantages(t([sign, sign]), mask)
    opt = torch.optim.SGD([lp], lr=0.1)
    loss, _ = compute_policy_loss("ppo_clip", lp, old, adv, mask)
    loss.backward()
    opt.step()
    delta = (lp.detach() - old)[mask.bool()]
    assert (delta * sign > 0).all()
    assert (lp.detach() - old)[~mask.bool()].eq(0).all()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_corrupted_old_logprob_gives_a_finite_loss_and_gradient(sign):
    # A stale or corrupted old log-prob (-1e4) makes the log-ratio 1e4: exp overflows to
    # inf unless it is clamped first (to LOG_RATIO_CLAMP, as SkyRL does).
    lp = torch.log(t([0.2, 0.5, 0.3], [0.1, 0.6, 0.3])).requires_grad_(True)
    old = lp.detach().clone()
    old[0, 1] = -1e4
    mask, adv = torch.ones(2, 3), torch.full((2, 3), sign)
    for clip_ratio_c in (None, 3.0):
        loss, stats = ppo_clip_loss(lp, old, adv, mask, clip_ratio_c=clip_ratio_c)
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(math.isfinite(float(v)) for v in stats.values())
        assert float(stats["ratio_max"]) == pytest.approx(math.exp(LOG_RATIO_CLAMP), rel=1e-5)
        assert grad[0, 1] == 0.0  # past the clamp the token has no gradient
        assert (grad[1] != 0).all()  # the healthy tokens still learn


def test_all_zero_mask_gives_finite_zero_loss_and_gradient():
    lp = torch.randn(2, 3, requires_grad=True)
    old = torch.full((2, 3), -torch.inf)  # garbage in padding must not leak
    mask = torch.zeros(2, 3)
    for reduction in ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"]:
        loss, stats = ppo_clip_loss(
            lp, old, torch.ones(2, 3), mask, reduction=reduction, max_seq_len=3
        )
        loss.backward()
        assert torch.isfinite(loss) and loss.item() == 0.0
        assert torch.isfinite(lp.grad).all() and lp.grad.eq(0).all()
        assert all(math.isfinite(float(v)) for v in stats.values())
        lp.grad = None
    kl = kl_loss(lp, old, mask, "k3", "sequence_mean")
    assert torch.isfinite(kl) and kl.item() == 0.0


def test_ppo_clip_stats_are_detached_device_scalars_read_by_the_caller():
    # The stats stay 0-dim tensors (no .item() per micro-batch, which would make the host
    # wait for the device before the backward); ratio_max needs no boolean index either.
    lp, old, adv, mask = _clip_case()
    lp = lp.clone().requires_grad_(True)
    rollout = old + math.log(2.0)  # TIS weights 0.5
    options = {"clip_ratio_c": 3.0, "rollout_logprobs": rollout, "tis_imp_ratio_cap": 2.0}
    _, stats = ppo_clip_loss(lp, old, adv, mask, **options)
    assert set(stats) == {
        "clip_fraction",
        "dual_clip_fraction",
        "approx_kl",
        "ratio_mean",
        "ratio_max",
        "tis_weight_mean",
        "tis_capped_fraction",
    }
    for name, value in stats.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0, name
        assert not value.requires_grad and value.device == lp.device, name
    # The masked-out ratio 2.0 is no active token's: the largest active ratio is 1.5.
    assert float(stats["ratio_max"]) == pytest.approx(1.5)
    _, empty = ppo_clip_loss(lp, old, adv, torch.zeros_like(mask), **options)
    assert all(v.dim() == 0 and not v.requires_grad for v in empty.values())
    assert float(empty["ratio_max"]) == 0.0
    assert all(float(v) == 0.0 for v in empty.values()), empty
    none = torch.zeros(0, 3)
    _, shapeless = ppo_clip_loss(none, none, none, none)
    assert all(v.dim() == 0 and float(v) == 0.0 for v in shapeless.values()), shapeless


# ---------------------------------------------------------------- KL


def test_kl_estimators_on_hand_values():
    p, q = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    ln2 = math.log(2)
    close(kl_penalty(p, q, "k1"), [[ln2]])
    close(kl_penalty(p, q, "k2"), [[0.5 * ln2**2]])
    close(kl_penalty(p, q, "k3"), [[0.5 + ln2 - 1]])  # exp(q-p) - (q-p) - 1
    close(kl_penalty(p, q, "abs"), [[ln2]])
    close(kl_penalty(q, p, "abs"), [[ln2]])


def test_k3_is_non_negative_and_zero_when_equal():
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(4, 16, generator=g) * 3, torch.randn(4, 16, generator=g) * 3
    assert (kl_penalty(p, q, "k3") >= 0).all()
    assert kl_penalty(p, p, "k3").eq(0).all()
    # clamped log-ratio keeps extreme gaps finite
    assert torch.isfinite(kl_penalty(torch.tensor([[0.0]]), torch.tensor([[-1e4]]), "k3")).all()


def test_kl_loss_reuses_reductions():
    p = torch.log(t([0.5, 0.5], [0.5, 0.9]))
    q = torch.log(t([0.25, 0.5], [0.9, 0.5]))
    mask = t([1.0, 1.0], [0.0, 0.0])
    ln2 = math.log(2)
    close(kl_loss(p, q, mask, "k1", "token_mean"), ln2 / 2)
    close(kl_loss(p, q, mask, "k1", "sequence_mean"), ln2 / 2 / 2)


# ---------------------------------------------------------------- stats


def test_entropy_of_uniform_is_log_vocab():
    ent = entropy_from_logits(torch.zeros(2, 5, 7))
    close(ent, torch.full((2, 5), math.log(7)))


def test_entropy_matches_naive_and_chunking_and_handles_minus_inf():
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(1))
    p = logits.softmax(-1)
    naive = -(p * p.log()).sum(-1)
    close(entropy_from_logits(logits), naive, 1e-5)
    close(entropy_from_logits(logits, chunk_size=2), naive, 1e-5)
    one_hot = torch.full((1, 1, 4), -torch.inf)
    one_hot[..., 2] = 0.0
    close(entropy_from_logits(one_hot), [[0.0]])


def test_entropy_gradient_is_finite_with_banned_ids_and_equals_the_allowed_ids_gradient():
    # The entropy bonus differentiates through logits with banned ids at -inf (the forced
    # reply format): the gradient must be that of the entropy over the allowed ids alone.
    g = torch.Generator().manual_seed(3)
    allowed = torch.randn(2, 3, 4, generator=g)
    full = torch.cat([allowed, torch.full((2, 3, 5), -torch.inf)], dim=-1).requires_grad_()
    entropy_from_logits(full, temperature=0.8).sum().backward()
    ref = allowed.clone().requires_grad_()
    entropy_from_logits(ref, temperature=0.8).sum().backward()
    assert torch.isfinite(full.grad).all()
    close(full.grad[..., :4], ref.grad, 1e-6)
    close(full.grad[..., 4:], torch.zeros(2, 3, 5))


def test_logprobs_from_logits_matches_naive_including_bf16_and_temperature():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 6, 13, generator=g) * 4
    tokens = torch.randint(0, 13, (3, 6), generator=g)
    naive = torch.log(torch.softmax(logits, -1)).gather(-1, tokens[..., None]).squeeze(-1)
    close(logprobs_from_logits(logits, tokens), naive, 1e-5)
    close(logprobs_from_logits(logits, tokens, chunk_size=4), naive, 1e-5)
    hot = torch.log(torch.softmax(logits / 0.7, -1)).gather(-1, tokens[..., None]).squeeze(-1)
    close(logprobs_from_logits(logits, tokens, temperature=0.7), hot, 1e-5)
    bf16 = logits.to(torch.bfloat16)
    out = logprobs_from_logits(bf16, tokens)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(bf16.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    close(out, ref, 1e-5)


def test_masked_mean_weights_and_empty_mask():
    x = t([1.0, 2.0], [3.0, 4.0])
    close(masked_mean(x, t([1.0, 0.0], [1.0, 1.0])), (1 + 3 + 4) / 3)
    close(masked_mean(x, t([1.0, 0.0], [0.0, 0.0]), dim=-1), [1.0, 0.0])
    close(masked_mean(x, torch.zeros(2, 2, dtype=torch.bool)), 0.0)


# ---------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("call", "accepted"),
    [
        (lambda: get_estimator("ppo"), ["'grpo'", "'rloo'", "'gigpo'"]),
        (lambda: get_policy_loss("ppo"), ["'ppo_clip'"]),
        (lambda: get_kl_estimator("k4"), ["'k1'", "'k2'", "'k3'", "'abs'"]),
        (
            lambda: reduce_loss(VALUES, MASK, "mean"),
            ["'token_mean'", "'sequence_mean'", "'seq_mean_token_sum_norm'"],
        ),
        (lambda: kl_loss(VALUES, VALUES, MASK, "k9"), ["'k3'"]),
    ],
)
def test_unknown_names_raise_value_error_listing_accepted(call, accepted):
    with pytest.raises(ValueError, match="accepted") as info:
        call()
    for name in accepted:
        assert name in str(info.value)
