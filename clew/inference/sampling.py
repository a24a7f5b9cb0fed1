"""Sampling one token: the sampling settings, the ids a reply may never hold, top-k/top-p,
and the tokens a reply is restricted to.

Pure functions on logits, shared by the rollout engine (which samples) and the policy
worker (which must compute the same distribution when it recomputes logprobs).

``allowed_tokens`` is vLLM's ``allowed_token_ids`` by text: every other id goes to -inf
*before* the softmax, so the logprob the engine records and the one the worker recomputes
are those of the distribution renormalised over the allowed tokens: what the rest of the
vocabulary holds is neither drawn nor trained on. Top-k/top-p differ: they shape only the
draw while the logprobs stay those of the full distribution, so a negative advantage on a
drawn token pushes mass onto tokens that are never drawn and so never pushed back
(BENCHMARKS.md, "Thirty-first attempt": with ``top_k=5`` the replies that were not an
action rose from 0.1% to 70% of the sampled turns in 25 GRPO steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clew.errors import ClewError
from clew.models.chat import ChatFormat


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


def allowed_token_ids(chat: ChatFormat, texts: tuple[str, ...] | list[str]) -> torch.Tensor:
    """The ids of ``texts``, each of which must be exactly one token of ``chat``'s tokenizer."""
    ids = []
    for text in texts:
        encoded = chat.encode_text(text)
        if len(encoded) != 1:
            pieces = [chat.decode([i]) for i in encoded]
            raise ClewError(
                f"allowed token {text!r} is {len(encoded)} tokens of this model's tokenizer "
                f"({pieces}); each allowed token must be exactly one token (e.g. an action "
                "word after a reply_prefix such as '<action>')"
            )
        ids.append(encoded[0])
    return torch.tensor(sorted(set(ids)), dtype=torch.long)


class AllowedIds:
    """``allowed_token_ids`` of one tokenizer, resolved once per tuple of texts and kept on
    ``device``: the engine looks them up at every sampled token, the worker at every forward."""

    def __init__(self, chat: ChatFormat, device: torch.device | str) -> None:
        self.chat, self.device = chat, device
        self._ids: dict[tuple[str, ...], torch.Tensor] = {}

    def __call__(self, texts: tuple[str, ...]) -> torch.Tensor:
        if texts not in self._ids:
            self._ids[texts] = allowed_token_ids(self.chat, texts).to(self.device)
        return self._ids[texts]


def keep_allowed(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` [..., V] with every id outside ``allowed`` at -inf (out of place)."""
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[allowed.to(logits.device)] = True
    return logits.masked_fill(~keep, float("-inf"))
