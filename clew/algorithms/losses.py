"""Policy-gradient losses and the token reductions they share.

A loss is a pure function of per-token tensors of one micro-batch:
``logprobs`` (current policy, carries the gradient), ``old_logprobs`` (the policy that
sampled the rollout), ``advantages`` and ``loss_mask``, all ``Float[N, T]``. It returns a
scalar to ``backward()`` and a dict of statistics to log. Losses live in ``POLICY_LOSSES``
under a config name; add one with ``@register_policy_loss("name")``.

The statistics are detached 0-dim tensors on the loss's device, computed without reading
anything back to the host (no ``.item()``, ``float()`` or ``bool()`` of a tensor, no boolean
indexing): each such read makes the host wait for the device before it can launch the
backward, once per micro-batch. The caller reads them, all in one copy per mini-batch
(``clew.train.worker.PolicyWorker.accumulate``).

How per-token values become one scalar matters as much as the loss itself, and is a separate
choice (``reduction``) shared with the KL term:

* ``token_mean``: every masked token in the batch weighs the same. Long trajectories dominate.
* ``sequence_mean``: average within each sequence, then over sequences (GRPO paper). Each
  trajectory weighs the same, so tokens of long ones are down-weighted (a length bias).
* ``seq_mean_token_sum_norm``: sum within each sequence divided by a *constant*
  ``max_seq_len``, then mean over sequences (Dr. GRPO). No length bias and, because the
  divisor does not depend on the batch, micro-batches accumulate to the same gradient as
  one big batch.

The sequence reductions divide by the number of sequences ``N``, counting sequences whose
mask is all zero (they contribute 0), as SkyRL does. Nothing here yields NaN on an empty mask.

Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783) is no
loss of its own: it is ``ppo_clip`` under ``seq_mean_token_sum_norm`` with GRPO advantages
that are not divided by the group's std (``trainer.algorithm.norm_adv_by_std_in_grpo=false``,
so ``A_i = r_i - mean(group)``), as SkyRL configures it.

The losses registered here: ``ppo_clip`` (config name ``regular``). The other built-in ones,
each from its paper, are in ``clew.algorithms.policy_losses`` (``gspo``, ``cispo``,
``sapo``) and ``clew.algorithms.covariance_losses`` (``clip_cov``, ``kl_cov``).
"""

from collections.abc import Callable

import torch
from torch import Tensor

from clew.algorithms.logprob_gap import tis_weights
from clew.algorithms.stats import masked_mean, masked_sum, upcast_float
from clew.registry import lookup, register

REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")

# The PPO log-ratio is clamped to +-LOG_RATIO_CLAMP before exp, as SkyRL does: exp(20) is
# finite in float32, so one stale or corrupted old log-prob cannot overflow the ratio to inf
# (an inf loss, a NaN gradient); past the clamp the token gets no gradient.
LOG_RATIO_CLAMP = 20.0


def check_2d(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"expected tensors of one shape [N, T], got {shapes}")


def masked_fraction(flags: Tensor, active: Tensor) -> Tensor:
    """Share of the active tokens where ``flags`` holds (0 when none is active): a detached
    0-dim tensor."""
    with torch.no_grad():
        return masked_mean(flags.float(), active.float())


def check_clip_range(eps_clip_low: float, eps_clip_high: float, names: str) -> None:
    """Refuse a negative clip range (``names`` say which settings it came from)."""
    if eps_clip_low < 0 or eps_clip_high < 0:
        raise ValueError(f"{names} must both be >= 0, got {eps_clip_low} and {eps_clip_high}")


def log_ratio_on_mask(logprobs: Tensor, old_logprobs: Tensor, active: Tensor) -> Tensor:
    """``logprobs - old_logprobs`` clamped to +-:data:`LOG_RATIO_CLAMP` on the ``active``
    tokens and 0 elsewhere, float32 at least: padding with -inf old log-probs, or one
    corrupted token, would otherwise overflow ``exp`` to inf and the backward pass to NaN."""
    log_ratio = upcast_float(logprobs) - upcast_float(old_logprobs)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(active, log_ratio, 0.0)


def ratio_stats(ratio: Tensor, log_ratio: Tensor, active: Tensor) -> dict[str, Tensor]:
    """``approx_kl`` (k3: ``r - 1 - log r``), ``ratio_mean`` and ``ratio_max`` over the
    active tokens; 0 each when there are none. Detached 0-dim tensors, computed without a
    host synchronisation (no boolean indexing, no ``bool(active.any())``)."""
    with torch.no_grad():
        weight = active.float()
        zero = ratio.new_zeros(())
        if ratio.numel():  # a shape, known on the host
            largest = torch.where(active, ratio, -torch.inf).max()
            largest = torch.where(active.any(), largest, zero)
        else:
            largest = zero
        return {
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, weight),
            "ratio_mean": masked_mean(ratio, weight),
            "ratio_max": largest,
        }


def truncated_is(
    losses: Tensor,
    active: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor | None,
    cap: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``losses`` times the TIS weights ``min(exp(old - rollout), cap)`` (no gradient), and
    their stats (detached 0-dim tensors); ``losses`` unchanged and no stats when
    ``rollout_logprobs`` is None."""
    if rollout_logprobs is None:
        return losses, {}
    if cap is None:
        raise ValueError("TIS (rollout_logprobs given) needs a tis_imp_ratio_cap > 0")
    check_2d(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    weights = torch.where(active, tis_weights(old_logprobs, rollout_logprobs, cap), 0.0)
    with torch.no_grad():
        capped = (weights >= cap) & active
        stats = {
            "tis_weight_mean": masked_mean(weights, active.float()),
            "tis_capped_fraction": masked_fraction(capped, active),
        }
    return losses * weights, stats


def reduce_loss(
    values: Tensor,
    mask: Tensor,
    reduction: str = "token_mean",
    max_seq_len: int | None = None,
) -> Tensor:
    """Reduce per-token ``values: Float[N, T]`` under ``mask: Float[N, T]`` to a scalar.

    Args:
        values: per-token loss terms; entries where ``mask == 0`` are ignored (even inf/NaN).
        mask: 1 (or a weight) on tokens that count, 0 elsewhere.
        reduction: one of :data:`REDUCTIONS` (see the module docstring).
        max_seq_len: the constant divisor of ``seq_mean_token_sum_norm``; required there
            (use the configured max prompt + response length, not the padded ``T`` of the
            micro-batch, which varies). Ignored by the other reductions.

    Returns:
        A 0-dim tensor; 0 when the mask is all zero.
    """
    check_2d(values=values, mask=mask)
    if reduction == "token_mean":
        return masked_mean(values, mask)
    if reduction == "sequence_mean":
        return masked_mean(values, mask, dim=-1).mean() if values.shape[0] else values.sum()
    if reduction == "seq_mean_token_sum_norm":
        if max_seq_len is None or max_seq_len <= 0:
            raise ValueError(
                f"reduction 'seq_mean_token_sum_norm' needs a positive max_seq_len, "
                f"got {max_seq_len}"
            )
        per_seq = masked_sum(values, mask, dim=-1) / max_seq_len
        return per_seq.mean() if values.shape[0] else values.sum()
    accepted = ", ".join(repr(r) for r in REDUCTIONS)
    raise ValueError(f"unknown reduction {reduction!r}; accepted: {accepted}")


PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""``fn(logprobs, old_logprobs, advantages, loss_mask, *, reduction, max_seq_len, **cfg)``:
the loss and its stats, detached 0-dim tensors (see the module docstring)."""

POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: add a policy loss to :data:`POLICY_LOSSES` under ``name``."""
    return register(POLICY_LOSSES, name, "policy loss")


# SkyRL's names for losses registered here under another (``trainer.algorithm.policy_loss_type``).
LOSS_ALIASES = {"regular": "ppo_clip"}


def policy_loss_name(policy_loss_type: str) -> str:
    """The registered loss a ``trainer.algorithm.policy_loss_type`` value names."""
    return LOSS_ALIASES.get(policy_loss_type, policy_loss_type)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``; ``ValueError`` listing accepted names if none."""
    return lookup(POLICY_LOSSES, name, "policy loss")


def compute_policy_loss(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    **kwargs,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Look up ``name`` and call it; ``kwargs`` go to the loss (reduction, clip ranges, ...)."""
    return get_policy_loss(name)(logprobs, old_logprobs, advantages, loss_mask, **kwargs)


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    reduction: str = "token_mean",
    max_seq_len: int | None = None,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    rollout_logprobs: Tensor | None = None,
    tis_imp_ratio_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, with asymmetric clip range, optional dual clip and optional
    truncated importance sampling (TIS).

    Per token, with ``ratio = exp(clamp(logprobs - old_logprobs, -20, 20))`` (see
    :data:`LOG_RATIO_CLAMP`) and advantage ``A``::

        loss = -min(ratio * A, clamp(ratio, 1 - eps_clip_low, 1 + eps_clip_high) * A)
        if clip_ratio_c is set and A < 0:  loss = min(loss, -clip_ratio_c * A)

    The clip removes the incentive to move a token's ratio past ``1 + eps_clip_high`` when
    ``A > 0`` or below ``1 - eps_clip_low`` when ``A < 0`` (the gradient there is 0); a larger
    ``eps_clip_high`` ("clip-higher", DAPO) leaves room for rare tokens to grow. Dual clip
    (Ye et al. 2020) bounds the loss of a token with ``A < 0`` whose ratio has blown up.
    With ``rollout_logprobs`` (the engine's, where ``old_logprobs`` are the trainer's) each
    token's loss is then multiplied by ``min(exp(old_logprobs - rollout_logprobs),
    tis_imp_ratio_cap)`` before the reduction, as SkyRL's ``use_tis``
    (``clew.algorithms.logprob_gap.tis_weights``).

    Args:
        logprobs: ``Float[N, T]`` current policy log-probs of the sampled tokens (with grad).
        old_logprobs: ``Float[N, T]`` log-probs under the sampling policy (no grad needed).
        advantages: ``Float[N, T]`` per-token advantages (see ``token_advantages``).
        loss_mask: ``Float[N, T]`` 1 on generated tokens that are trained on.
        reduction, max_seq_len: see :func:`reduce_loss`.
        eps_clip_low, eps_clip_high: clip range ``[1 - low, 1 + high]``; both >= 0.
        clip_ratio_c: dual-clip bound (> 1), or None for off.
        rollout_logprobs: ``Float[N, T]`` the engine's sampling logprobs, or None: no TIS.
        tis_imp_ratio_cap: the TIS weights' upper bound (> 0); required with
            ``rollout_logprobs``.

    Returns:
        ``(loss, stats)``: a 0-dim tensor, and detached 0-dim tensors over masked tokens (0
        when the mask is empty; the caller reads them, see the module docstring):
        ``clip_fraction`` (share where the clipped branch is the one in effect),
        ``dual_clip_fraction`` (share where the dual clip is in effect; 0 when off),
        ``approx_kl`` (mean k3 estimate of KL(old || current): ``r - 1 - log r`` with
        ``r = exp(logprobs - old_logprobs)``; unbiased under samples from the old policy and
        never negative), ``ratio_mean`` and ``ratio_max``; with TIS also ``tis_weight_mean``
        and ``tis_capped_fraction`` (share of tokens whose weight the cap bounds).
    """
    check_2d(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask
    )
    if eps_clip_low < 0 or eps_clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got {eps_clip_low=} {eps_clip_high=}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or None), got {clip_ratio_c}")

    active = loss_mask != 0
    log_ratio = log_ratio_on_mask(logprobs, old_logprobs, active)
    ratio = torch.exp(log_ratio)
    adv = upcast_float(advantages)

    surr = ratio * adv
    surr_clipped = torch.clamp(ratio, 1.0 - eps_clip_low, 1.0 + eps_clip_high) * adv
    losses = -torch.minimum(surr, surr_clipped)
    clipped = surr_clipped < surr
    dual = torch.zeros_like(clipped)
    if clip_ratio_c is not None:
        bound = -clip_ratio_c * adv
        dual = (adv < 0) & (bound < losses)
        losses = torch.where(dual, bound, losses)
    losses, tis = truncated_is(losses, active, old_logprobs, rollout_logprobs, tis_imp_ratio_cap)

    loss = reduce_loss(losses, loss_mask, reduction, max_seq_len)

    with torch.no_grad():
        stats = {
            "clip_fraction": masked_fraction(clipped, active),
            "dual_clip_fraction": masked_fraction(dual, active),
        }
    return loss, stats | ratio_stats(ratio, log_ratio, active) | tis
