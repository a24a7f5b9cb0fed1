"""The policy losses of clew.algorithms.policy_losses against their papers' formulas.

Each loss is checked against a direct re-computation of its paper's objective on small
hand-made tensors (values, and gradients through autograd), then on the edge cases every
loss must survive: an empty mask, padding with -inf old log-probs, an extreme log-ratio.
Dr. GRPO, which is a configuration of ``ppo_clip`` rather than a loss, is checked the same
way, and so is the path from ``trainer.algorithm`` to each loss's keyword arguments.
"""

import math

import pytest
import torch

from clew.algorithms import (
    LOG_RATIO_CLAMP,
    POLICY_LOSSES,
    EstimatorBatch,
    cispo_loss,
    clip_cov_loss,
    compute_advantages,
    compute_policy_loss,
    get_policy_loss,
    gspo_loss,
    kl_cov_loss,
    ppo_clip_loss,
    sapo_loss,
    token_advantages,
)
from clew.config import load_config
from clew.config.settings import ppo_settings
from clew.errors import ConfigError

NEW_LOSSES = ("gspo", "cispo", "clip_cov", "kl_cov", "sapo")
CPU_DEMO = "recipes/cpu-demo.yaml"


def t(*rows):
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=torch.float32)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0
    )


def value_and_grad(fn, logprobs):
    """``fn(lp)``'s value and its gradient with respect to ``lp``, a fresh leaf."""
    lp = logprobs.detach().clone().requires_grad_(True)
    out = fn(lp)
    loss = out[0] if isinstance(out, tuple) else out
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


# ---------------------------------------------------------------- GSPO


def _gspo_case():
    # Three sequences, old log-probs -1 everywhere; the masked log-ratios have means
    # 2e-4 (s inside (1 - 3e-4, 1 + 4e-4)), 1e-3 (above) and -1e-3 (below). Sequence 1 has
    # A > 0, so its ratio is clipped; sequence 2 has A < 0 and a low ratio: clipped too.
    delta = t([3e-4, 1e-4, 2e-4], [2e-3, 0.0, 0.0], [-1e-3, -1e-3, 0.0])
    mask = t([1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0])
    old = torch.where(mask > 0, -1.0, -torch.inf)  # padding: garbage old log-probs
    adv = token_advantages(t([1.0, 2.0, -1.0]), mask)
    return old + delta, old, adv, mask


def _gspo_paper(lp, old, adv, mask, low=3e-4, high=4e-4):
    """GSPO, eq. 5 of arXiv 2507.18071: one ratio per sequence, the length-normalised
    likelihood ratio ``(pi / pi_old) ** (1 / |y|)``, and one advantage per sequence."""
    per_seq = []
    for i in range(lp.shape[0]):
        on = mask[i] > 0
        s = (lp[i][on].sum() - old[i][on].sum()).div(int(on.sum())).exp()
        a = adv[i][on][0]
        per_seq.append(torch.minimum(s * a, s.clamp(1 - low, 1 + high) * a))
    return -torch.stack(per_seq).mean()


def test_gspo_matches_the_sequence_level_objective_in_value_and_gradient():
    lp, old, adv, mask = _gspo_case()
    loss, grad = value_and_grad(
        lambda x: gspo_loss(x, old, adv, mask, eps_clip_low=3e-4, eps_clip_high=4e-4), lp
    )
    want, want_grad = value_and_grad(lambda x: _gspo_paper(x, old, adv, mask), lp)
    close(loss, want)
    close(grad, want_grad)
    # Unclipped: each token gets s_i * A_i / |y_i| / G; the clipped sequences get nothing.
    s0 = math.exp(2e-4)
    close(grad[0], [-s0 * 1.0 / 3 / 3] * 3)
    assert grad[1:].eq(0).all()


def test_gspo_token_matches_eq_14_with_per_token_advantages():
    lp, old, _, mask = _gspo_case()
    lp = torch.where(mask > 0, lp, 0.0)  # as the trainer's, 0 off the mask
    adv = t([1.0, -2.0, 0.5], [0.3, 1.0, 0.0], [-1.0, 2.0, 0.0])
    low, high = 0.2, 0.2  # wide, so every token is unclipped

    def paper(x):
        # s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)], eq. 14, in probability space.
        seq = ((x - old) * mask).nan_to_num(0.0).sum(-1) / mask.sum(-1)
        s_it = seq.exp().detach()[:, None] * x.exp() / x.exp().detach()
        terms = torch.minimum(s_it * adv, s_it.clamp(1 - low, 1 + high) * adv)
        return -((terms * mask).sum(-1) / mask.sum(-1)).mean()

    loss, grad = value_and_grad(
        lambda x: gspo_loss(x, old, adv, mask, eps_clip_low=low, eps_clip_high=high), lp
    )
    want, want_grad = value_and_grad(paper, lp)
    close(loss, want)
    close(grad, want_grad)


def test_gspo_stats_count_clipped_tokens_and_report_sequence_ratios():
    lp, old, adv, mask = _gspo_case()
    _, stats = gspo_loss(lp, old, adv, mask)
    # sequences 1 and 2 are clipped, 2 tokens each
    assert float(stats["clip_fraction"]) == pytest.approx(4 / 7)
    ratios = [math.exp(2e-4), math.exp(1e-3), math.exp(-1e-3)]
    assert float(stats["ratio_mean"]) == pytest.approx(sum(ratios) / 3)
    assert float(stats["ratio_max"]) == pytest.approx(max(ratios))


# ---------------------------------------------------------------- CISPO


def _token_case():
    # (ratio, A) per masked token: (1.5, +1) above the range, (0.5, -1) below it,
    # (1.1, +2) inside, (0.9, -0.5) inside; one padded token with -inf old log-prob.
    ratio = t([1.5, 0.5, 1.0], [1.1, 0.9, 1.0])
    adv = t([1.0, -1.0, 0.0], [2.0, -0.5, 0.0])
    mask = t([1.0, 1.0, 0.0], [1.0, 1.0, 0.0])
    base = torch.log(t([0.3, 0.2, 0.5], [0.4, 0.1, 0.5]))
    old = torch.where(mask > 0, base - ratio.log(), -torch.inf)
    return base, old, adv, mask


def test_cispo_matches_the_papers_clipped_is_weight_reinforce():
    lp, old, adv, mask = _token_case()
    low, high = 0.2, 0.2

    def paper(x):
        # MiniMax-M1 eq. 4: J = 1 / sum|o_i| * sum sg(clip(r, 1 - low, 1 + high)) * A * log pi
        on = mask > 0
        r = (x[on] - old[on]).exp()
        return -(r.clamp(1 - low, 1 + high).detach() * adv[on] * x[on]).sum() / on.sum()

    kwargs = {"cispo_eps_clip_low": low, "cispo_eps_clip_high": high}
    loss, grad = value_and_grad(lambda x: cispo_loss(x, old, adv, mask, **kwargs), lp)
    want, want_grad = value_and_grad(paper, lp)
    close(loss, want)
    close(grad, want_grad)
    # Clipped tokens keep a gradient, weighed at the bound (PPO's clip would give them 0).
    close(grad[0, :2], [-1.2 * 1.0 / 4, -0.8 * -1.0 / 4])
    _, stats = cispo_loss(lp, old, adv, mask, **kwargs)
    assert float(stats["clip_fraction"]) == pytest.approx(0.5)
    assert float(stats["weight_mean"]) == pytest.approx((1.2 + 0.8 + 1.1 + 0.9) / 4)


def test_cispo_default_range_is_zero_to_five():
    lp = torch.zeros(1, 3)
    old = torch.log(t([[1 / 7.0, 1 / 0.5, 1 / 0.01]]))  # ratios 7, 0.5, 0.01
    _, grad = value_and_grad(lambda x: cispo_loss(x, old, torch.ones(1, 3), torch.ones(1, 3)), lp)
    close(grad, [[-5.0 / 3, -0.5 / 3, -0.01 / 3]], atol=1e-6)


# ---------------------------------------------------------------- Clip-Cov


def _cov_case():
    # Every token masked but the last; centred log-probs and advantages chosen so that the
    # covariances (A - mean A) * (log pi - mean log pi) are easy to read.
    lp = t([-1.0, -3.0, -0.5, -2.0], [-0.2, -2.5, -1.5, -9.0])
    adv = t([2.0, -1.0, 1.5, 0.0], [3.0, 1.0, -2.0, 0.0])
    mask = t([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0])
    old = lp.clone()  # on policy: PPO's clip touches nothing
    old[1, 3] = -torch.inf
    return lp, old, adv, mask


def _cov(lp, adv, mask):
    on = mask > 0
    a, p = adv[on], lp[on]
    cov = torch.zeros_like(lp)
    cov[on] = (a - a.mean()) * (p - p.mean())
    return cov


def test_clip_cov_removes_the_gradient_of_tokens_with_covariance_in_bounds():
    lp, old, adv, mask = _cov_case()
    cov = _cov(lp, adv, mask)
    lb, ub = 0.5, 3.0
    picked = (cov > lb) & (cov < ub) & (mask > 0)
    assert 0 < int(picked.sum()) < int(mask.sum())  # the case selects some, not all

    def paper(x):
        # Cui et al. eq. 11: the PPO surrogate, and 0 for the tokens in I_clip.
        r = torch.where(mask > 0, x - old, 0.0).exp()
        ppo = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
        return torch.where(picked | (mask == 0), 0.0, ppo).sum() / mask.sum()

    # clip_ratio 1: as many tokens as there are candidates, so the draw takes them all.
    kwargs = {"clip_ratio": 1.0, "clip_cov_lb": lb, "clip_cov_ub": ub}
    loss, grad = value_and_grad(lambda x: clip_cov_loss(x, old, adv, mask, **kwargs), lp)
    want, want_grad = value_and_grad(paper, lp)
    close(loss, want)
    close(grad, want_grad)
    assert grad[picked].eq(0).all() and grad[~picked & (mask > 0) & (adv != 0)].ne(0).all()
    _, stats = clip_cov_loss(lp, old, adv, mask, **kwargs)
    assert float(stats["cov_clip_fraction"]) == pytest.approx(int(picked.sum()) / 7)
    assert float(stats["clip_fraction"]) == float(stats["cov_clip_fraction"])
    assert float(stats["ppo_clip_fraction"]) == 0.0


def test_clip_cov_draws_its_share_at_random_among_the_candidates_only():
    lp, old, adv, mask = _cov_case()
    cov = _cov(lp, adv, mask)
    candidates = (cov > -100.0) & (cov < 100.0) & (mask > 0)  # every masked token
    kwargs = {"clip_ratio": 2 / 7, "clip_cov_lb": -100.0, "clip_cov_ub": 100.0}

    def removed(seed):
        gen = torch.Generator().manual_seed(seed)
        _, grad = value_and_grad(
            lambda x: clip_cov_loss(x, old, adv, mask, generator=gen, **kwargs), lp
        )
        return (grad == 0) & (mask > 0) & (adv != 0)

    draws = [removed(seed) for seed in range(6)]
    for draw in draws:
        assert int(draw.sum()) in (1, 2)  # 2 drawn, one of which may carry A = 0 anyway
        assert not (draw & ~candidates).any()
    assert removed(3).equal(draws[3])  # the same generator state, the same draw
    assert len({tuple(d.flatten().tolist()) for d in draws}) > 1


def test_clip_cov_leaves_ppo_clipped_tokens_out_of_the_draw():
    lp = t([[0.0, 0.0]])
    old = t([[-math.log(1.5), 0.0]])  # token 0: ratio 1.5, A > 0: PPO-clipped
    adv, mask = t([[2.0, -2.0]]), torch.ones(1, 2)
    _, stats = clip_cov_loss(
        lp, old, adv, mask, clip_ratio=1.0, clip_cov_lb=-100.0, clip_cov_ub=100.0
    )
    assert float(stats["ppo_clip_fraction"]) == 0.5 and float(stats["cov_clip_fraction"]) == 0.5
    assert float(stats["clip_fraction"]) == 1.0


# ---------------------------------------------------------------- KL-Cov


def test_kl_cov_penalises_the_top_share_by_covariance():
    lp, old, adv, mask = _cov_case()
    old = torch.where(mask > 0, lp - t([0.1, -0.2, 0.3, 0.0], [-0.1, 0.2, 0.05, 0.0]), -torch.inf)
    cov = _cov(lp, adv, mask)
    k = int(0.3 * 7)  # 2 of the 7 masked tokens
    top = cov.masked_fill(mask == 0, -torch.inf).flatten().topk(k).indices
    selected = torch.zeros(8, dtype=torch.bool)
    selected[top] = True
    selected = selected.view(2, 4)

    def paper(x):
        # Cui et al. eq. 12: r * A, minus beta * |log r| on the tokens in I_KL (no clip).
        log_r = torch.where(mask > 0, x - old, 0.0)
        terms = -log_r.exp() * adv + torch.where(selected, 0.5 * log_r.abs(), 0.0)
        return (terms * mask).sum() / mask.sum()

    kwargs = {"kl_cov_frac": 0.3, "ppo_kl_coef": 0.5}
    loss, grad = value_and_grad(lambda x: kl_cov_loss(x, old, adv, mask, **kwargs), lp)
    want, want_grad = value_and_grad(paper, lp)
    close(loss, want)
    close(grad, want_grad)
    _, stats = kl_cov_loss(lp, old, adv, mask, **kwargs)
    assert (
        float(stats["kl_cov_fraction"]) == pytest.approx(2 / 7)
        and float(stats["clip_fraction"]) == 0.0
    )


def test_kl_cov_without_penalty_is_the_unclipped_surrogate():
    lp, old, adv, mask = _token_case()
    loss, _ = kl_cov_loss(lp, old, adv, mask, ppo_kl_coef=0.0)
    close(loss, -(1.5 * 1 + 0.5 * -1 + 1.1 * 2 + 0.9 * -0.5) / 4)


# ---------------------------------------------------------------- SAPO


def test_sapo_matches_the_soft_gate_objective():
    lp, old, adv, mask = _token_case()
    tau_pos, tau_neg = 1.0, 2.0

    def paper(x):
        # SAPO: f(r) = sigmoid(tau * (r - 1)) * 4 / tau, tau by the advantage's sign;
        # per-sequence token means, then the mean over sequences.
        r = torch.where(mask > 0, x - old, 0.0).exp()
        tau = torch.where(adv > 0, tau_pos, tau_neg)
        terms = torch.sigmoid(tau * (r - 1)) * 4 / tau * adv
        return -((terms * mask).sum(-1) / mask.sum(-1)).mean()

    kwargs = {"tau_pos": tau_pos, "tau_neg": tau_neg}
    loss, grad = value_and_grad(lambda x: sapo_loss(x, old, adv, mask, **kwargs), lp)
    want, want_grad = value_and_grad(paper, lp)
    close(loss, want)
    close(grad, want_grad)


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    lp = torch.log(t([0.3, 0.2, 0.5], [0.4, 0.1, 0.5]))
    adv, mask = t([1.0, -1.0, 2.0], [0.5, -3.0, 0.0]), t([1.0, 1.0, 1.0], [1.0, 1.0, 0.0])
    _, grad = value_and_grad(lambda x: sapo_loss(x, lp, adv, mask), lp)
    close(grad, -adv * mask / mask.sum(-1, keepdim=True) / 2)
    _, stats = sapo_loss(lp, lp, adv, mask)
    assert float(stats["gate_weight_mean"]) == pytest.approx(1.0)
    assert float(stats["clip_fraction"]) == 0.0 and float(stats["approx_kl"]) == 0.0


# ---------------------------------------------------------------- Dr. GRPO


def test_dr_grpo_is_ppo_clip_with_unnormalised_advantages_and_a_constant_divisor():
    # Two groups of two; sequences of 2, 3, 1 and 2 trained tokens, at most 3.
    rewards, groups = t([1.0, 0.0, 0.25, 1.0]), torch.tensor([0, 0, 1, 1])
    mask = t([1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0])
    old = torch.log(torch.full((4, 3), 0.3))
    lp = old + t([0.1, -0.3, 0.0], [0.05, 0.0, 0.4], [-0.3, 0.0, 0.0], [0.0, 0.1, 0.0])
    max_len = 16
    cfg = load_config(
        None,
        [
            "trainer.algorithm.norm_adv_by_std_in_grpo=false",
            "trainer.algorithm.loss_reduction=seq_mean_token_sum_norm",
            "generator.max_input_length=16",
            "trainer.max_prompt_length=8",
            "generator.sampling_params.max_generate_length=8",
            "generator.eval_sampling_params.max_generate_length=8",
        ],
    )
    settings = ppo_settings(cfg)
    result = compute_advantages(
        "grpo", EstimatorBatch(rewards, groups), cfg.trainer.algorithm.model_dump()
    )
    close(result.advantages, [0.5, -0.5, -0.375, 0.375])  # r - mean(group), no std
    adv = token_advantages(result.advantages, mask)
    assert (settings.policy_loss, settings.max_seq_len) == ("ppo_clip", max_len)

    def paper(x):
        # Dr. GRPO (arXiv 2503.20783): 1/G sum_i sum_t min(r A, clip(r) A), the per-sequence
        # sum divided by a constant (the generation budget) instead of |o_i|.
        a = (rewards - rewards.view(2, 2).mean(-1).repeat_interleave(2))[:, None]
        r = (x - old).exp()
        terms = torch.minimum(r * a, r.clamp(0.8, 1.2) * a) * mask
        return -(terms.sum(-1) / max_len).mean()

    loss, grad = value_and_grad(
        lambda x: compute_policy_loss(
            settings.policy_loss,
            x,
            old,
            adv,
            mask,
            reduction=settings.loss_reduction,
            max_seq_len=settings.max_seq_len,
            **settings.loss_options,
        ),
        lp,
    )
    want, want_grad = value_and_grad(paper, lp)
    close(loss, want)
    close(grad, want_grad)


# ---------------------------------------------------------------- every loss


def _loss(name, **kwargs):
    if name == "clip_cov":
        kwargs.setdefault("clip_ratio", 0.5)
        kwargs.setdefault("generator", torch.Generator().manual_seed(0))
    return lambda *tensors, **more: get_policy_loss(name)(*tensors, **kwargs, **more)


@pytest.mark.parametrize("name", NEW_LOSSES)
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"])
def test_an_empty_mask_gives_a_zero_loss_and_gradient_and_finite_stats(name, reduction):
    lp = torch.randn(2, 3)
    old = torch.full((2, 3), -torch.inf)  # garbage in padding must not leak
    loss, grad = value_and_grad(
        lambda x: _loss(name)(
            x, old, torch.ones(2, 3), torch.zeros(2, 3), reduction=reduction, max_seq_len=3
        ),
        lp,
    )
    assert loss.item() == 0.0 and grad.eq(0).all()
    _, stats = _loss(name)(lp, old, torch.ones(2, 3), torch.zeros(2, 3))
    assert {"clip_fraction", "approx_kl"} <= set(stats)
    assert all(float(v) == 0.0 for v in stats.values()), stats


@pytest.mark.parametrize("name", NEW_LOSSES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("corrupt", [-1e4, 1e4])
def test_an_extreme_log_ratio_gives_a_finite_loss_and_gradient(name, sign, corrupt):
    # One stale or corrupted old log-prob: the log-ratio is clamped to +-LOG_RATIO_CLAMP.
    lp = torch.log(t([0.2, 0.5, 0.3], [0.1, 0.6, 0.3]))
    old = lp.clone()
    old[0, 1] = corrupt
    adv, mask = torch.full((2, 3), sign), torch.ones(2, 3)
    loss, grad = value_and_grad(lambda x: _loss(name)(x, old, adv, mask), lp)
    _, stats = _loss(name)(lp, old, adv, mask)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(float(v)) for v in stats.values()), stats
    assert (grad[1] != 0).any()  # the healthy sequence still learns
    if name != "gspo" and corrupt < 0:
        assert float(stats["ratio_max"]) == pytest.approx(math.exp(LOG_RATIO_CLAMP), rel=1e-5)


@pytest.mark.parametrize("name", ["gspo", "cispo", "sapo"])
def test_truncated_importance_sampling_weighs_each_tokens_loss(name):
    lp, old, adv, mask = _token_case()
    rollout = old + math.log(2.0)  # exp(old - rollout) = 0.5 on every token
    plain, _ = _loss(name)(lp, old, adv, mask)
    weighted, stats = _loss(name)(
        lp, old, adv, mask, rollout_logprobs=rollout, tis_imp_ratio_cap=2.0
    )
    close(weighted, 0.5 * plain)
    assert float(stats["tis_weight_mean"]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="tis_imp_ratio_cap"):
        _loss(name)(lp, old, adv, mask, rollout_logprobs=rollout)


@pytest.mark.parametrize(
    ("name", "kwargs", "says"),
    [
        ("gspo", {"eps_clip_low": -0.1}, r"eps_clip_low and eps_clip_high must both be >= 0"),
        ("cispo", {"cispo_eps_clip_high": -1.0}, r"cispo_eps_clip_high must both be >= 0"),
        ("clip_cov", {"clip_ratio": 0.0}, r"clip_ratio must be in \(0, 1\]"),
        ("clip_cov", {"clip_ratio": 1.5}, r"clip_ratio must be in \(0, 1\]"),
        ("clip_cov", {"clip_cov_lb": 5.0, "clip_cov_ub": 1.0}, r"clip_cov_lb must be below"),
        ("clip_cov", {"eps_clip_high": -0.2}, r"must both be >= 0"),
        ("kl_cov", {"kl_cov_frac": 0.0}, r"kl_cov_frac must be in \(0, 1\]"),
        ("kl_cov", {"ppo_kl_coef": -1.0}, r"ppo_kl_coef must be >= 0"),
        ("sapo", {"tau_neg": 0.0}, r"tau_pos and tau_neg must both be > 0"),
        ("gspo", {"reduction": "sum"}, r"accepted: 'token_mean'"),
    ],
)
def test_out_of_range_settings_name_the_accepted_range(name, kwargs, says):
    lp, old, adv, mask = _token_case()
    with pytest.raises(ValueError, match=says):
        _loss(name, **kwargs)(lp, old, adv, mask)


def test_every_new_loss_is_registered_alongside_ppo_clip():
    assert set(NEW_LOSSES) | {"ppo_clip"} <= set(POLICY_LOSSES)
    assert POLICY_LOSSES["gspo"] is gspo_loss and POLICY_LOSSES["cispo"] is cispo_loss
    assert get_policy_loss("ppo_clip") is ppo_clip_loss


# ---------------------------------------------------------------- from the config


@pytest.mark.parametrize(
    ("loss_type", "overrides", "options"),
    [
        ("regular", [], {"eps_clip_low": 0.2, "eps_clip_high": 0.2, "clip_ratio_c": None}),
        (
            "gspo",
            ["trainer.algorithm.eps_clip_low=3e-4", "trainer.algorithm.eps_clip_high=4e-4"],
            {"eps_clip_low": 3e-4, "eps_clip_high": 4e-4},
        ),
        (
            "cispo",
            ["trainer.algorithm.cispo.cispo_eps_clip_high=2.0"],
            {"cispo_eps_clip_low": 1.0, "cispo_eps_clip_high": 2.0},
        ),
        (
            "clip_cov",
            ["trainer.algorithm.clip_cov.clip_ratio=0.5"],
            {
                "eps_clip_low": 0.2,
                "eps_clip_high": 0.2,
                "clip_ratio": 0.5,
                "clip_cov_lb": 1.0,
                "clip_cov_ub": 5.0,
            },
        ),
        (
            "kl_cov",
            ["trainer.algorithm.kl_cov.ppo_kl_coef=0.1"],
            {"kl_cov_frac": 0.2, "ppo_kl_coef": 0.1},
        ),
        ("sapo", ["trainer.algorithm.sapo.tau_neg=2.0"], {"tau_pos": 1.0, "tau_neg": 2.0}),
    ],
)
def test_each_policy_loss_type_loads_and_its_settings_reach_the_loss(loss_type, overrides, options):
    cfg = load_config(CPU_DEMO, [f"trainer.algorithm.policy_loss_type={loss_type}", *overrides])
    settings = ppo_settings(cfg)
    assert settings.policy_loss == ("ppo_clip" if loss_type == "regular" else loss_type)
    assert dict(settings.loss_options) == options
    lp, old, adv, mask = _token_case()
    loss, stats = compute_policy_loss(
        settings.policy_loss,
        lp,
        old,
        adv,
        mask,
        reduction=settings.loss_reduction,
        max_seq_len=settings.max_seq_len,
        **settings.loss_options,
    )
    assert torch.isfinite(loss) and {"clip_fraction", "approx_kl"} <= set(stats)


def test_an_unknown_policy_loss_type_lists_the_accepted_ones():
    with pytest.raises(ConfigError) as err:
        load_config(CPU_DEMO, ["trainer.algorithm.policy_loss_type=gpso"])
    message = str(err.value)
    assert "[policy-loss]" in message and "did you mean 'gspo'?" in message
    for name in ("regular", "ppo_clip", *NEW_LOSSES):
        assert repr(name) in message


@pytest.mark.parametrize(
    ("overrides", "rule"),
    [
        (["trainer.algorithm.clip_cov.clip_cov_lb=6.0"], "clip-cov-bounds"),
        (
            ["trainer.algorithm.policy_loss_type=gspo", "trainer.algorithm.clip_ratio_c=3.0"],
            "clip-ratio-c",
        ),
        (
            [
                "trainer.algorithm.use_tis=true",
                "trainer.algorithm.tis_imp_ratio_cap=2.0",
                "trainer.algorithm.policy_loss_type=kl_cov",
            ],
            "loss-tis",
        ),
    ],
)
def test_policy_loss_rules_reject_settings_the_loss_cannot_honour(overrides, rule):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert f"[{rule}]" in str(err.value)
    assert overrides[-1].split("=", 1)[1] in str(err.value)


@pytest.mark.parametrize(
    "override",
    [
        "trainer.algorithm.cispo.cispo_eps_clip_low=-0.5",
        "trainer.algorithm.clip_cov.clip_ratio=0.0",
        "trainer.algorithm.kl_cov.kl_cov_frac=1.5",
        "trainer.algorithm.kl_cov.ppo_kl_coef=-1.0",
        "trainer.algorithm.sapo.tau_pos=0.0",
    ],
)
def test_section_values_out_of_range_are_config_errors_naming_the_key(override):
    key = override.split("=", 1)[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])
