"""Per-token logprobs and entropy from final hidden states, a chunk of tokens at a time.

The plain path projects every loss-mask position onto the vocabulary at once: ``[K, V]``
float32 logits, kept alive for backward with the softmax's own ``[K, V]`` temporaries. With
Qwen's 151,936-entry vocabulary that is 0.6 MB per token: the generated tokens of a large
micro-batch make it the largest tensor of the step, larger than the model at a few
thousand tokens. Here the output projection (``lm_head``) runs on ``chunk_size`` tokens at
a time; under autograd each chunk is checkpointed, so backward recomputes its logits and
only one chunk's ``[chunk_size, V]`` exists at any moment, forward or backward. The
recomputation costs one more pass of the projection, what a custom backward would spend
too (it must rebuild the softmax). Calling the projection module itself keeps whatever it
is: a LoRA-wrapped head, or a sharded model's gathered root.

The masks and the temperature are the sampler's (``clew.models.logit_masks``), applied in
the same order as on the whole logits, so the numbers equal the plain path's to float
rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from clew.algorithms import entropy_from_logits, logprobs_from_logits
from clew.models.logit_masks import keep_allowed, mask_banned

__all__ = ["TokenLogprobs", "token_logprobs"]


@dataclass
class TokenLogprobs:
    """Per target token, in the order of the hidden states given."""

    logprobs: Tensor  # Float[K]: log softmax((masked logits) / temperature)[target]
    entropy: Tensor | None  # Float[K] of the same distribution, when asked for
    greedy: Tensor  # Long[K]: the id of the largest masked logit


def _chunk(
    head: torch.nn.Module,
    hidden: Tensor,
    targets: Tensor,
    banned: Tensor,
    allowed: Tensor | None,
    temperature: float,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    logits = mask_banned(head(hidden).float(), banned)
    if allowed is not None:
        logits = keep_allowed(logits, allowed)
    logprobs = logprobs_from_logits(logits[None], targets[None], temperature=temperature)[0]
    if with_entropy:
        entropy = entropy_from_logits(logits[None], temperature=temperature)[0]
    else:
        entropy = logprobs.new_zeros(0)
    return logprobs, entropy, logits.detach().argmax(-1)


def token_logprobs(
    hidden: Tensor,
    head: torch.nn.Module,
    targets: Tensor,
    *,
    banned: Tensor,
    allowed: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> TokenLogprobs:
    """Logprobs of ``targets [K]`` under ``head(hidden [K, H])``, ``chunk_size`` tokens a pass.

    ``banned``: ids set to -inf (the vision placeholders); ``allowed``: when given, every
    other id is -inf too; ``temperature`` divides the masked logits. ``with_entropy`` also
    returns each distribution's entropy (differentiable, for an entropy bonus). Gradients
    flow to ``hidden`` and the head's trainable weights.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden states but {targets.shape[0]} targets")
    grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    pieces = []
    for start in range(0, max(hidden.shape[0], 1), chunk_size):
        args = (
            head,
            hidden[start : start + chunk_size],
            targets[start : start + chunk_size],
            banned,
            allowed,
            temperature,
            with_entropy,
        )
        # Non-reentrant: it restores the autocast state of the forward when it recomputes.
        pieces.append(checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args))
    logprobs, entropy, greedy = (torch.cat(p) for p in zip(*pieces, strict=True))
    return TokenLogprobs(logprobs, entropy if with_entropy else None, greedy)
