"""Sampling one token: the sampling settings, the ids a reply may never hold, top-k/top-p.

Pure functions on logits, shared by the rollout engine (which samples) and the policy
worker (which must compute the same distribution when it recomputes logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clew.models.chat import ChatFormat


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one reply (SkyRL's ``generator.sampling_params``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def banned_token_ids(chat: ChatFormat) -> torch.Tensor:
    """Token ids a reply may never contain: the vision placeholders and delimiters."""
    ids = {chat.image_token_id, chat.vision_start_id, chat.vision_end_id}
    video = chat.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    if isinstance(video, int) and video != chat.tokenizer.unk_token_id:
        ids.add(video)
    return torch.tensor(sorted(i for i in ids if i is not None), dtype=torch.long)


def mask_banned(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """``logits`` [..., V] with the banned ids at -inf (out of place)."""
    return logits.index_fill(-1, banned.to(logits.device), float("-inf"))


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
