"""Policy losses from the literature beyond PPO's clip, under SkyRL's config names.

Each is a registered policy loss (``clew.algorithms.losses``): a pure function of
``Float[N, T]`` tensors ``logprobs`` (with grad), ``old_logprobs``, ``advantages`` and
``loss_mask`` returning ``(loss, stats)``, reduced with ``reduction`` (``reduce_loss``), and
chosen with ``trainer.algorithm.policy_loss_type``:

* ``gspo``: GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization",
  https://arxiv.org/abs/2507.18071): PPO's clip on one importance ratio per sequence.
* ``cispo``: CISPO (MiniMax 2025, "MiniMax-M1", https://arxiv.org/abs/2506.13585):
  REINFORCE weighted by the clipped, detached importance ratio.
* ``clip_cov`` and ``kl_cov``: Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism
  of Reinforcement Learning for Reasoning Language Models", https://arxiv.org/abs/2505.22617):
  PPO-style losses that act on the few tokens whose log-prob and advantage covary most, the
  tokens that drive the policy's entropy down.
* ``sapo``: SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization",
  https://arxiv.org/abs/2511.20347): a smooth sigmoid gate on the ratio instead of a clip.

Their semantics follow SkyRL 0.4's implementations (``skyrl_train.utils.ppo_utils``) with
clew's numerics: every log-ratio is clamped to +-``LOG_RATIO_CLAMP`` on the mask and 0 off it
before ``exp``, so padding and corrupted old log-probs stay finite, and an all-zero mask gives
a loss and gradient of 0. ``gspo``, ``cispo`` and ``sapo`` take SkyRL's truncated importance
sampling (``rollout_logprobs``, ``tis_imp_ratio_cap``) as ``ppo_clip`` does; ``clip_cov`` and
``kl_cov`` do not (SkyRL refuses off-policy correction with them too). Their settings come
from ``trainer.algorithm`` (``clew.config.settings.policy_loss_options``).

Every loss returns ``clip_fraction`` and ``approx_kl`` (the k3 estimate of KL(old || current)
over the masked tokens, as ``ppo_clip``), 0 when the mask is empty. Every stat is a detached
0-dim tensor on the loss's device, computed without a host synchronisation; the caller reads
them (see ``clew.algorithms.losses``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from clew.algorithms.losses import (
    check_2d,
    log_ratio_on_mask,
    ratio_stats,
    reduce_loss,
    register_policy_loss,
    truncated_is,
)
from clew.algorithms.stats import masked_mean, upcast_float

__all__ = ["cispo_loss", "clip_cov_loss", "gspo_loss", "kl_cov_loss", "sapo_loss"]


def _fraction(flags: Tensor, active: Tensor) -> Tensor:
    """Share of the active tokens where ``flags`` holds (0 when none is active): a detached
    0-dim tensor."""
    with torch.no_grad():
        return masked_mean(flags.float(), active.float())


def _check_clip_range(eps_clip_low: float, eps_clip_high: float, names: str) -> None:
    if eps_clip_low < 0 or eps_clip_high < 0:
        raise ValueError(f"{names} must both be >= 0, got {eps_clip_low} and {eps_clip_high}")


@register_policy_loss("gspo")
def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    reduction: str = "sequence_mean",
    max_seq_len: int | None = None,
    eps_clip_low: float = 3e-4,
    eps_clip_high: float = 4e-4,
    rollout_logprobs: Tensor | None = None,
    tis_imp_ratio_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token (Zheng et al. 2025, arXiv 2507.18071, eqs. 13-14): PPO's clipped surrogate
    on a sequence-level importance ratio.

    Sequence ``i``'s ratio is the geometric mean of its tokens' ratios, ``s_i = exp(mean_t
    (logprobs - old_logprobs))`` over its masked tokens (weighted by the mask). Token ``t``
    uses ``s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]``: its value is ``s_i``, its gradient that of
    ``s_i * log pi(y_t)``, so with one advantage per sequence the gradient is the paper's
    ``s_i * A_i * mean_t grad log pi(y_t)`` under ``sequence_mean``. Per token::

        loss = -min(s_it * A, clamp(s_it, 1 - eps_clip_low, 1 + eps_clip_high) * A)

    Every token of a sequence shares its ratio, so a sequence is clipped (no gradient) as a
    whole where its advantage keeps one sign. The paper's clip range is (3e-4, 4e-4), far
    narrower than PPO's token range because a geometric mean moves far less; the config's
    range is ``trainer.algorithm.eps_clip_low`` / ``eps_clip_high``, shared with ``regular``,
    as in SkyRL. The paper averages per sequence (``reduction="sequence_mean"``).

    Args:
        logprobs, old_logprobs, advantages, loss_mask: ``Float[N, T]`` as ``ppo_clip_loss``.
        reduction, max_seq_len: see ``reduce_loss``.
        eps_clip_low, eps_clip_high: clip range ``[1 - low, 1 + high]`` of ``s_i``; both >= 0.
        rollout_logprobs, tis_imp_ratio_cap: truncated importance sampling, as
            ``ppo_clip_loss``.

    Returns:
        ``(loss, stats)``: ``clip_fraction`` (share of masked tokens where the clipped branch
        is in effect), ``approx_kl`` (per token, from the token log-ratios), ``ratio_mean``
        and ``ratio_max`` (of ``s_i`` over the sequences with a masked token), plus TIS stats.
    """
    check_2d(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask
    )
    _check_clip_range(eps_clip_low, eps_clip_high, "eps_clip_low and eps_clip_high")
    active = loss_mask != 0
    token_log_ratio = log_ratio_on_mask(logprobs, old_logprobs, active)
    seq_log_ratio = masked_mean(token_log_ratio, loss_mask, dim=-1).detach()  # log s_i
    lp = upcast_float(logprobs)
    grad_only = torch.where(active, lp - lp.detach(), 0.0)  # 0 in value, grad of log pi
    ratio = torch.exp(seq_log_ratio[:, None] + grad_only)
    adv = upcast_float(advantages)

    surr = ratio * adv
    surr_clipped = torch.clamp(ratio, 1.0 - eps_clip_low, 1.0 + eps_clip_high) * adv
    losses = -torch.minimum(surr, surr_clipped)
    losses, tis = truncated_is(losses, active, old_logprobs, rollout_logprobs, tis_imp_ratio_cap)
    loss = reduce_loss(losses, loss_mask, reduction, max_seq_len)

    with torch.no_grad():
        token_stats = ratio_stats(token_log_ratio.exp(), token_log_ratio, active)
        seq_stats = ratio_stats(
            seq_log_ratio.exp()[:, None], seq_log_ratio[:, None], active.any(dim=-1, keepdim=True)
        )
        stats = {
            "clip_fraction": _fraction(surr_clipped < surr, active),
            "approx_kl": token_stats["approx_kl"],
            "ratio_mean": seq_stats["ratio_mean"],
            "ratio_max": seq_stats["ratio_max"],
        }
    return loss, stats | tis


@register_policy_loss("cispo")
def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    reduction: str = "token_mean",
    max_seq_len: int | None = None,
    cispo_eps_clip_low: float = 1.0,
    cispo_eps_clip_high: float = 4.0,
    rollout_logprobs: Tensor | None = None,
    tis_imp_ratio_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4): REINFORCE weighted by the clipped and
    detached importance ratio. Per token, with ``r = exp(logprobs - old_logprobs)``::

        loss = -sg(clamp(r, 1 - cispo_eps_clip_low, 1 + cispo_eps_clip_high)) * A * logprobs

    Unlike PPO's clip, which drops the gradient of a token whose ratio left the range, CISPO
    only bounds the token's weight: every token keeps a gradient ``-w * A * grad log pi``, so
    rare tokens that PPO clips early in training still learn. The value itself (a multiple of
    ``logprobs``) carries no meaning; its gradient does. The paper normalises over the
    group's tokens (``token_mean``) and bounds the weight above only; the defaults, SkyRL's,
    give the range [0, 5] (ScaleRL's, arXiv 2510.13786).

    Args:
        logprobs, old_logprobs, advantages, loss_mask: ``Float[N, T]`` as ``ppo_clip_loss``.
        reduction, max_seq_len: see ``reduce_loss``.
        cispo_eps_clip_low, cispo_eps_clip_high: the weight's range ``[1 - low, 1 + high]``;
            both >= 0.
        rollout_logprobs, tis_imp_ratio_cap: truncated importance sampling, as
            ``ppo_clip_loss``.

    Returns:
        ``(loss, stats)``: ``clip_fraction`` (share of masked tokens whose weight the range
        bounds), ``weight_mean`` (mean clipped weight), ``approx_kl``, ``ratio_mean``,
        ``ratio_max``, plus TIS stats.
    """
    check_2d(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask
    )
    _check_clip_range(
        cispo_eps_clip_low, cispo_eps_clip_high, "cispo_eps_clip_low and cispo_eps_clip_high"
    )
    active = loss_mask != 0
    log_ratio = log_ratio_on_mask(logprobs, old_logprobs, active)
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - cispo_eps_clip_low, 1.0 + cispo_eps_clip_high
    weight = torch.clamp(ratio, low, high).detach()
    lp = torch.where(active, upcast_float(logprobs), 0.0)
    losses = -weight * upcast_float(advantages) * lp
    losses, tis = truncated_is(losses, active, old_logprobs, rollout_logprobs, tis_imp_ratio_cap)
    loss = reduce_loss(losses, loss_mask, reduction, max_seq_len)

    with torch.no_grad():
        stats = {
            "clip_fraction": _fraction((ratio < low) | (ratio > high), active),
            "weight_mean": masked_mean(weight, active.float()),
        }
    return loss, stats | ratio_stats(ratio, log_ratio, active) | tis


def _covariance(logprobs: Tensor, advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """Per token ``(A - mean A) * (log pi - mean log pi)``, the means over the masked tokens
    (mask-weighted) of the micro-batch; no gradient. Cui et al. 2025 (sec. 4.1) show that
    the entropy change of a policy-gradient step follows this covariance."""
    with torch.no_grad():
        active = loss_mask != 0
        lp = torch.where(active, upcast_float(logprobs), 0.0)
        adv = torch.where(active, upcast_float(advantages), 0.0)
        return (adv - masked_mean(adv, loss_mask)) * (lp - masked_mean(lp, loss_mask))


@register_policy_loss("clip_cov")
def clip_cov_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    reduction: str = "token_mean",
    max_seq_len: int | None = None,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    clip_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617, sec. 4.2): PPO's clipped surrogate, with
    the gradient of a few high-covariance tokens removed.

    Per token the loss is ``ppo_clip_loss``'s (no dual clip). Among the masked tokens that
    PPO's clip left alone, those whose covariance ``(A - mean A) * (log pi - mean log pi)``
    (means over the micro-batch's masked tokens) lies strictly between ``clip_cov_lb`` and
    ``clip_cov_ub`` are candidates; ``max(1, int(clip_ratio * masked tokens))`` of them,
    drawn uniformly at random, count 0 in the loss (no gradient). Those tokens are the ones
    whose update would lower the policy's entropy most, so the policy keeps exploring. The
    covariance is over the micro-batch, as in SkyRL; the reduction still counts the removed
    tokens.

    Args:
        logprobs, old_logprobs, advantages, loss_mask: ``Float[N, T]`` as ``ppo_clip_loss``.
        reduction, max_seq_len: see ``reduce_loss``.
        eps_clip_low, eps_clip_high: PPO's clip range; both >= 0.
        clip_ratio: share of masked tokens removed, in (0, 1] (the paper: 2e-4).
        clip_cov_lb, clip_cov_ub: the candidates' covariance bounds, ``lb < ub`` (the paper:
            1 and 5).
        generator: the random draw's ``torch.Generator`` (on the CPU); None: torch's global
            one.

    Returns:
        ``(loss, stats)``: ``clip_fraction`` (share of masked tokens with no gradient: PPO's
        clip or the covariance's, which never overlap), ``ppo_clip_fraction``,
        ``cov_clip_fraction``, ``approx_kl``, ``ratio_mean``, ``ratio_max``.
    """
    check_2d(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask
    )
    _check_clip_range(eps_clip_low, eps_clip_high, "eps_clip_low and eps_clip_high")
    if not 0.0 < clip_ratio <= 1.0:
        raise ValueError(f"clip_ratio must be in (0, 1], got {clip_ratio}")
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(
            f"clip_cov_lb must be below clip_cov_ub, got {clip_cov_lb} and {clip_cov_ub}"
        )
    active = loss_mask != 0
    log_ratio = log_ratio_on_mask(logprobs, old_logprobs, active)
    ratio = torch.exp(log_ratio)
    adv = upcast_float(advantages)
    surr = ratio * adv
    surr_clipped = torch.clamp(ratio, 1.0 - eps_clip_low, 1.0 + eps_clip_high) * adv
    losses = -torch.minimum(surr, surr_clipped)
    ppo_clipped = (surr_clipped < surr) & active

    cov = _covariance(logprobs, advantages, loss_mask)
    candidates = active & ~ppo_clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    where = candidates.flatten().nonzero().squeeze(-1)
    count = min(max(int(clip_ratio * int(active.sum())), 1), where.numel())
    order = torch.randperm(where.numel(), generator=generator)[:count]
    removed = torch.zeros_like(active).flatten()
    removed[where[order.to(where.device)]] = True
    removed = removed.view_as(active)
    losses = torch.where(removed, 0.0, losses)
    loss = reduce_loss(losses, loss_mask, reduction, max_seq_len)

    stats = {
        "clip_fraction": _fraction(ppo_clipped | removed, active),
        "ppo_clip_fraction": _fraction(ppo_clipped, active),
        "cov_clip_fraction": _fraction(removed, active),
    }
    return loss, stats | ratio_stats(ratio, log_ratio, active)


@register_policy_loss("kl_cov")
def kl_cov_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    reduction: str = "token_mean",
    max_seq_len: int | None = None,
    kl_cov_frac: float = 0.2,
    ppo_kl_coef: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617, sec. 4.2): the unclipped surrogate, plus a
    KL penalty on the tokens whose log-prob and advantage covary most.

    Per token, with ``r = exp(logprobs - old_logprobs)``::

        loss = -r * A                                  (every masked token)
             + ppo_kl_coef * |logprobs - old_logprobs|  (the top kl_cov_frac by covariance)

    The selected tokens are the ``max(1, int(kl_cov_frac * masked tokens))`` masked tokens of
    the micro-batch with the largest ``(A - mean A) * (log pi - mean log pi)`` (means over the
    masked tokens): the ones whose update lowers the policy's entropy most, held near the
    old policy instead. There is no ratio clip, as in the paper and SkyRL. The paper and
    verl select a share of 2e-4 to 2e-3; SkyRL's default ``kl_cov_frac`` is 0.2.

    Args:
        logprobs, old_logprobs, advantages, loss_mask: ``Float[N, T]`` as ``ppo_clip_loss``.
        reduction, max_seq_len: see ``reduce_loss``.
        kl_cov_frac: share of masked tokens penalised, in (0, 1].
        ppo_kl_coef: the penalty's weight, >= 0.

    Returns:
        ``(loss, stats)``: ``clip_fraction`` (0: nothing is clipped), ``kl_cov_fraction``
        (share of masked tokens penalised), ``approx_kl``, ``ratio_mean``, ``ratio_max``.
    """
    check_2d(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask
    )
    if not 0.0 < kl_cov_frac <= 1.0:
        raise ValueError(f"kl_cov_frac must be in (0, 1], got {kl_cov_frac}")
    if ppo_kl_coef < 0:
        raise ValueError(f"ppo_kl_coef must be >= 0, got {ppo_kl_coef}")
    active = loss_mask != 0
    log_ratio = log_ratio_on_mask(logprobs, old_logprobs, active)
    ratio = torch.exp(log_ratio)
    losses = -ratio * upcast_float(advantages)

    cov = _covariance(logprobs, advantages, loss_mask).flatten()
    where = active.flatten().nonzero().squeeze(-1)
    count = min(max(int(kl_cov_frac * where.numel()), 1), where.numel())
    top = where[torch.topk(cov[where], count).indices]
    selected = torch.zeros_like(active).flatten()
    selected[top] = True
    selected = selected.view_as(active)
    losses = losses + torch.where(selected, ppo_kl_coef * log_ratio.abs(), 0.0)
    loss = reduce_loss(losses, loss_mask, reduction, max_seq_len)

    stats = {"clip_fraction": ratio.new_zeros(()), "kl_cov_fraction": _fraction(selected, active)}
    return loss, stats | ratio_stats(ratio, log_ratio, active)


@register_policy_loss("sapo")
def sapo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    reduction: str = "sequence_mean",
    max_seq_len: int | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    rollout_logprobs: Tensor | None = None,
    tis_imp_ratio_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): a soft, temperature-controlled gate on the
    ratio in place of PPO's hard clip. Per token, with ``r = exp(logprobs - old_logprobs)``
    and ``tau = tau_pos`` where ``A > 0``, else ``tau_neg``::

        loss = -(4 / tau) * sigmoid(tau * (r - 1)) * A

    Its gradient is ``-4 * s * (1 - s) * r * A * grad log pi`` with ``s = sigmoid(tau * (r -
    1))``: exactly the policy gradient at ``r = 1``, fading smoothly (not at once, as PPO's
    clip) as the ratio moves away, the faster the larger ``tau``. The paper takes ``tau_neg >
    tau_pos`` (negative-advantage updates spread over many tokens of the vocabulary and
    destabilise more) and averages per sequence (``reduction="sequence_mean"``).

    Args:
        logprobs, old_logprobs, advantages, loss_mask: ``Float[N, T]`` as ``ppo_clip_loss``.
        reduction, max_seq_len: see ``reduce_loss``.
        tau_pos, tau_neg: the gate's temperatures for positive and other advantages; > 0.
        rollout_logprobs, tis_imp_ratio_cap: truncated importance sampling, as
            ``ppo_clip_loss``.

    Returns:
        ``(loss, stats)``: ``clip_fraction`` (0: nothing is clipped), ``gate_weight_mean``
        (mean of ``4 * s * (1 - s)``, the gate's scaling of each token's gradient; 1 on
        policy), ``approx_kl``, ``ratio_mean``, ``ratio_max``, plus TIS stats.
    """
    check_2d(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask
    )
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos and tau_neg must both be > 0, got {tau_pos} and {tau_neg}")
    active = loss_mask != 0
    log_ratio = log_ratio_on_mask(logprobs, old_logprobs, active)
    ratio = torch.exp(log_ratio)
    adv = upcast_float(advantages)
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(adv.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    losses = -(4.0 / tau) * gate * adv
    losses, tis = truncated_is(losses, active, old_logprobs, rollout_logprobs, tis_imp_ratio_cap)
    loss = reduce_loss(losses, loss_mask, reduction, max_seq_len)

    with torch.no_grad():
        stats = {
            "clip_fraction": ratio.new_zeros(()),
            "gate_weight_mean": masked_mean(4.0 * gate * (1.0 - gate), active.float()),
        }
    return loss, stats | ratio_stats(ratio, log_ratio, active) | tis
