"""Masks over the vocabulary that sampling and training must apply alike.

The rollout engine samples from masked logits and records the logprobs of that
distribution; the policy worker recomputes those logprobs for the update. Both must mask the
same ids the same way, or the PPO ratio is not 1 at the first update, so the masks live here,
on the model side, where both import them.

``allowed_tokens`` is vLLM's ``allowed_token_ids`` by text: every other id goes to -inf
*before* the softmax, so the logprob the engine records and the one the worker recomputes
are those of the distribution renormalised over the allowed tokens: what the rest of the
vocabulary holds is neither drawn nor trained on.
"""

from __future__ import annotations

import torch

from clew.errors import ClewError
from clew.models.chat import ChatFormat


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
