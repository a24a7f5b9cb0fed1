"""Sampling one token: the sampling settings and top-k/top-p.

The vocabulary masks that sampling and training share (banned vision ids, ``allowed_tokens``)
are ``clew.models.logit_masks``. Top-k/top-p differ from ``allowed_tokens``: they shape only
the draw while the logprobs stay those of the full distribution, so a negative advantage on a
drawn token pushes mass onto tokens that are never drawn and so never pushed back (with
``top_k=5`` the replies that were not an action rose from almost none to most of the sampled
turns within a short GRPO run on ``maze_2d/easy``; docs/learning-easy.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one reply (SkyRL's ``generator.sampling_params``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    allowed_tokens: tuple[str, ...] = ()  # empty: the whole vocabulary

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``, finite for any temperature > 0.

    A tiny temperature overflows the division (1e-300 even rounds to 0 in float32): the
    largest logit becomes inf (or 0 / 0, NaN) and the softmax NaN, which no draw takes. Such
    rows get the distribution's limit as the temperature goes to 0 instead: the largest
    logits share the mass evenly, every other token gets none."""
    scaled = logits / temperature
    top = logits.amax(-1, keepdim=True)
    overflow = ~torch.isfinite(scaled.amax(-1, keepdim=True))
    # (A row of NaN logits stays NaN, so that its draw fails rather than pick anything.)
    limit = torch.zeros_like(logits).masked_fill(~(logits >= top), float("-inf"))
    return torch.where(overflow, limit, scaled)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with everything outside top-k / the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p. The first always stays,
        # even for a top_p below float32's smallest number (it compares as 0 there, and
        # every token dropped would leave nothing to draw).
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
