"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", https://arxiv.org/abs/2505.22617): PPO-style policy losses that
act on the few tokens whose log-prob and advantage covary most, the tokens that drive the
policy's entropy down.

Registered as ``clip_cov`` and ``kl_cov`` (``trainer.algorithm.policy_loss_type``), pure
functions with the contract and numerics of ``clew.algorithms.policy_losses``; like SkyRL's,
they take no off-policy correction (``use_tis``).
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
)
from clew.algorithms.stats import masked_mean, upcast_float

__all__ = ["clip_cov_loss", "kl_cov_loss"]


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
    check_clip_range(eps_clip_low, eps_clip_high, "eps_clip_low and eps_clip_high")
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
        "clip_fraction": masked_fraction(ppo_clipped | removed, active),
        "ppo_clip_fraction": masked_fraction(ppo_clipped, active),
        "cov_clip_fraction": masked_fraction(removed, active),
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

    stats = {
        "clip_fraction": ratio.new_zeros(()),
        "kl_cov_fraction": masked_fraction(selected, active),
    }
    return loss, stats | ratio_stats(ratio, log_ratio, active)
