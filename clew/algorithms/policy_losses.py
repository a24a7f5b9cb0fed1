"""Policy losses from the literature beyond PPO's clip, under SkyRL's config names.

Each is a registered policy loss (``clew.algorithms.losses``): a pure function of
``Float[N, T]`` tensors ``logprobs`` (with grad), ``old_logprobs``, ``advantages`` and
``loss_mask`` returning ``(loss, stats)``, reduced with ``reduction`` (``reduce_loss``), and
chosen with ``trainer.algorithm.policy_loss_type``:

* ``gspo``: GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization",
  https://arxiv.org/abs/2507.18071): PPO's clip on one importance ratio per sequence.
* ``cispo``: CISPO (MiniMax 2025, "MiniMax-M1", https://arxiv.org/abs/2506.13585):
  REINFORCE weighted by the clipped, detached importance ratio.
* ``clip_cov`` and ``kl_cov``: in ``clew.algorithms.covariance_losses``.
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
    check_clip_range,
    log_ratio_on_mask,
    masked_fraction,
    ratio_stats,
    reduce_loss,
    register_policy_loss,
    truncated_is,
)
from clew.algorithms.stats import masked_mean, upcast_float

__all__ = ["cispo_loss", "gspo_loss", "sapo_loss"]


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
    check_clip_range(eps_clip_low, eps_clip_high, "eps_clip_low and eps_clip_high")
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
            "clip_fraction": masked_fraction(surr_clipped < surr, active),
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
    check_clip_range(
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
            "clip_fraction": masked_fraction((ratio < low) | (ratio > high), active),
            "weight_mean": masked_mean(weight, active.float()),
        }
    return loss, stats | ratio_stats(ratio, log_ratio, active) | tis


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
