"""KL penalty between the policy and a frozen reference, estimated on sampled tokens.

The exact KL needs the full vocabulary distribution of both models at every position. The
trainer only keeps the log-probabilities of the sampled tokens, so the penalty uses
Schulman's single-sample estimators (http://joschu.net/blog/kl-approx.html) of
``KL(policy || ref)`` with tokens drawn from the policy, ``log_ratio = logprobs - ref_logprobs``:

* ``k1``: ``log_ratio``. Unbiased, high variance, negative on individual tokens.
* ``k2``: ``0.5 * log_ratio**2``. Biased, low variance, never negative.
* ``k3``: ``exp(-log_ratio) + log_ratio - 1``. Unbiased, low variance, never negative; the
  usual choice ("low_var_kl" in verl/SkyRL).
* ``abs``: ``|log_ratio|``.

``log_ratio`` is clamped to ``[-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP]`` before any
estimator: ``exp(20)`` is finite in float32, and a token that far from the reference gets no
extra gradient from the penalty (the clamp's gradient is 0 there) rather than inf/NaN. Add an
estimator with ``@register_kl_estimator("name")``.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from clew.algorithms.losses import LOG_RATIO_CLAMP, reduce_loss
from clew.algorithms.stats import upcast_float
from clew.registry import lookup, register

KL_LOG_RATIO_CLAMP = LOG_RATIO_CLAMP

KLEstimator = Callable[[Tensor], Tensor]
"""``fn(log_ratio: Float[N, T]) -> Float[N, T]`` with ``log_ratio = log p - log q``."""

KL_ESTIMATORS: dict[str, KLEstimator] = {}


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    """Decorator: add an estimator ``fn(log_ratio) -> per-token KL`` under ``name``."""
    return register(KL_ESTIMATORS, name, "KL estimator")


def get_kl_estimator(name: str) -> KLEstimator:
    """The estimator registered as ``name``; ``ValueError`` listing accepted names if none."""
    return lookup(KL_ESTIMATORS, name, "KL estimator")


@register_kl_estimator("k1")
def kl_k1(log_ratio: Tensor) -> Tensor:
    """``log p - log q``."""
    return log_ratio


@register_kl_estimator("k2")
def kl_k2(log_ratio: Tensor) -> Tensor:
    """``0.5 * (log p - log q)**2``."""
    return 0.5 * log_ratio.square()


@register_kl_estimator("k3")
def kl_k3(log_ratio: Tensor) -> Tensor:
    """``exp(q - p) - (q - p) - 1`` in log space, i.e. ``r - 1 - log r`` with ``r = q / p``."""
    return torch.exp(-log_ratio) + log_ratio - 1.0


@register_kl_estimator("abs")
def kl_abs(log_ratio: Tensor) -> Tensor:
    """``|log p - log q|``."""
    return log_ratio.abs()


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: str = "k3",
    loss_mask: Tensor | None = None,
) -> Tensor:
    """Per-token KL estimate of ``KL(policy || ref)``.

    Args:
        logprobs: ``Float[N, T]`` policy log-probs of the sampled tokens (may carry grad).
        ref_logprobs: ``Float[N, T]`` reference log-probs of the same tokens.
        estimator: a name in :data:`KL_ESTIMATORS`.
        loss_mask: optional ``Float[N, T]``; where 0 the log-ratio is set to 0 first, so
            garbage in padding cannot overflow (the estimate there is then 0 for all
            built-in estimators).

    Returns:
        ``Float[N, T]`` in float32 (float64 if the inputs are).
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
            "differ in shape"
        )
    fn = get_kl_estimator(estimator)
    log_ratio = upcast_float(logprobs) - upcast_float(ref_logprobs)
    log_ratio = log_ratio.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    if loss_mask is not None:
        log_ratio = torch.where(loss_mask != 0, log_ratio, 0.0)
    return fn(log_ratio)


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    loss_mask: Tensor,
    estimator: str = "k3",
    reduction: str = "token_mean",
    max_seq_len: int | None = None,
) -> Tensor:
    """KL penalty reduced to a scalar: ``reduce_loss(kl_penalty(...), loss_mask, reduction)``.

    Shapes as in :func:`kl_penalty`; ``reduction`` and ``max_seq_len`` as in
    :func:`clew.algorithms.losses.reduce_loss`. Multiply by the KL coefficient outside.
    """
    per_token = kl_penalty(logprobs, ref_logprobs, estimator, loss_mask)
    return reduce_loss(per_token, loss_mask, reduction, max_seq_len)
