"""Token-level statistics from logits: log-probabilities, entropy, masked means.

Every loss in clew starts from the log-probability the policy gives each sampled token, and
the entropy of the policy is the first metric to watch for collapse. Both are computed from
``logits: Float[N, T, V]`` where ``V`` is a vocabulary of 100k-250k entries, so the naive
``log_softmax(logits.float())`` materialises a float32 copy of the largest tensor in the step.
The functions here use ``logits - logsumexp(logits)`` on the gathered entry only and can walk
the sequence axis in chunks, so the float32 temporaries are ``N * chunk * V`` instead of
``N * T * V``. Inputs in bf16/fp16 are upcast to float32 before any reduction: summing a
vocabulary of exponentials in bf16 loses the digits that a policy ratio depends on.

Masks are ``Float[N, T]`` (or bool) with 1 on tokens that count and 0 elsewhere (prompt,
observation and padding tokens of a multi-turn trajectory). Masked means return 0, not NaN,
when nothing is masked in, so an empty micro-batch cannot poison a gradient step.
"""

import torch
from torch import Tensor


def upcast_float(x: Tensor) -> Tensor:
    """``x`` in float32 at least: bf16/fp16 are upcast, float32/float64 are left as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x * mask`` over ``dim`` (all dims when None).

    ``x: Float[...]``, ``mask: Float[...]`` or ``Bool[...]`` of the same shape. Entries where
    ``mask == 0`` contribute exactly 0 even if ``x`` holds inf/NaN there (e.g. padding).
    """
    if x.shape != mask.shape:
        raise ValueError(f"x {tuple(x.shape)} and mask {tuple(mask.shape)} differ in shape")
    mask = mask.to(x.dtype) if mask.dtype == torch.bool else mask
    values = torch.where(mask != 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))
    return values.sum() if dim is None else values.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` weighted by ``mask`` over ``dim`` (all dims when None).

    ``x: Float[...]``, ``mask: Float[...]`` or ``Bool[...]``. Returns a scalar (``dim=None``)
    or the shape of ``x`` without ``dim``. Where the mask sums to 0 the result is 0 (no NaN,
    and no gradient flows).
    """
    total = masked_sum(x, mask, dim)
    weight = mask.to(total.dtype).sum() if dim is None else mask.to(total.dtype).sum(dim=dim)
    return torch.where(weight != 0, total / torch.where(weight != 0, weight, 1.0), 0.0)


def _chunks(t: int, chunk_size: int | None) -> list[slice]:
    if chunk_size is None or chunk_size >= t:
        return [slice(0, t)]
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size}")
    return [slice(s, min(s + chunk_size, t)) for s in range(0, t, chunk_size)]


def logprobs_from_logits(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> Tensor:
    """Log-probability of each token under its logits: ``log softmax(logits / temperature)[tok]``.

    Args:
        logits: ``Float[N, T, V]`` (any float dtype; reduced in float32). ``logits[:, t]`` must
            be the distribution that produced ``tokens[:, t]`` (shift before calling).
        tokens: ``Long[N, T]`` valid vocabulary ids; pad with any valid id (e.g. 0) and mask
            the padding out downstream, since -100 is not a valid index.
        temperature: the sampling temperature, so that log-probs match the sampler's.
        chunk_size: walk ``T`` in chunks of this many positions to bound the float32
            temporaries to ``N * chunk_size * V``. Under autograd the saved activations of
            each chunk still add up; chunking helps most under ``torch.no_grad``.

    Returns:
        ``Float[N, T]`` in float32 (float64 if the logits are float64), <= 0.
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [N, T, V] and tokens [N, T], got {tuple(logits.shape)} and "
            f"{tuple(tokens.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    out = []
    for sl in _chunks(logits.shape[1], chunk_size):
        chunk = upcast_float(logits[:, sl])
        if temperature != 1.0:
            chunk = chunk / temperature
        picked = torch.gather(chunk, -1, tokens[:, sl].unsqueeze(-1).long()).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def entropy_from_logits(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> Tensor:
    """Entropy of the categorical distribution at each position, in nats.

    ``H = logsumexp(z) - sum(softmax(z) * z)`` with ``z = logits / temperature``, which is exact
    and finite even where some logits are ``-inf`` (masked vocabulary entries).

    Args:
        logits: ``Float[N, T, V]`` (any float dtype; reduced in float32).
        temperature: the sampling temperature.
        chunk_size: walk ``T`` in chunks to bound float32 temporaries (see
            :func:`logprobs_from_logits`).

    Returns:
        ``Float[N, T]`` in [0, log V].
    """
    if logits.dim() != 3:
        raise ValueError(f"expected logits [N, T, V], got {tuple(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    out = []
    for sl in _chunks(logits.shape[1], chunk_size):
        z = upcast_float(logits[:, sl])
        if temperature != 1.0:
            z = z / temperature
        probs = torch.softmax(z, dim=-1)
        # A zero-probability entry contributes 0 to the expectation. Its -inf is replaced
        # before the product, not after: masking ``probs * z`` with a where still sends
        # ``z`` = -inf into the product's backward (0 * -inf), a NaN gradient (the entropy
        # bonus with banned ids).
        expected = (probs * torch.where(torch.isfinite(z), z, 0.0)).sum(dim=-1)
        out.append(torch.logsumexp(z, dim=-1) - expected)
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)
