"""Sampling one token: the sampling settings and top-k/top-p.

The vocabulary masks that sampling and training share (banned vision ids, ``allowed_tokens``)
are ``clew.models.logit_masks``. Top-k/top-p differ from ``allowed_tokens``: they shape only
the draw while the logprobs stay those of the full distribution, so a negative advantage on a
drawn token pushes mass onto tokens that are never drawn and so never pushed back (with
``top_k=5`` the replies that were not an action rose from 0.1% to 70% of the sampled turns in
25 GRPO steps on ``maze_2d/easy``; docs/learning-easy.md).
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


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with everything outside top-k / the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
