"""Which images a token may attend to when only the last K images stay in context.

With ``generator.keep_last_k_images = K``, from the turn that brings image ``m`` on, images
older than ``m - K + 1`` are hidden from every later token. The engine hides them by
masking their KV-cache columns (their keys stay in memory but receive no attention); the
trainer must reproduce exactly what each token saw, so it builds the same visibility as
a 4D attention mask from where each observation chunk started.

A token's *epoch* is the observation chunk it was fed with: the tokens of chunk ``j`` and
the reply that follows it, except the reply's last token, which the engine feeds at the
start of chunk ``j + 1`` (it is sampled last and fed with the next observation).
"""

from __future__ import annotations

import torch


def image_spans(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of image placeholder tokens, in order."""
    spans, start = [], None
    for i, t in enumerate(token_ids):
        if t == image_token_id and start is None:
            start = i
        elif t != image_token_id and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(token_ids)))
    return spans


def visibility_mask(
    token_ids: list[int], chunk_starts: list[int], image_token_id: int, keep_last_k: int
) -> torch.Tensor:
    """Bool ``[L, L]``: query ``q`` may attend to key ``k`` (causal, old images hidden)."""
    n = len(token_ids)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    spans = image_spans(token_ids, image_token_id)
    if not spans:
        return causal
    starts = torch.tensor(chunk_starts, dtype=torch.long)
    positions = torch.arange(n)
    epoch = torch.searchsorted(starts, positions + 1, right=True) - 1
    # Images fed up to and including each epoch (a chunk's images lie inside it).
    image_epoch = torch.searchsorted(starts, torch.tensor([s for s, _ in spans]), right=True) - 1
    images_upto = torch.stack([(image_epoch <= e).sum() for e in range(len(chunk_starts))])
    hidden_below = images_upto[epoch.clamp(min=0)] - keep_last_k  # per query
    image_of_key = torch.full((n,), -1, dtype=torch.long)
    for i, (s, e) in enumerate(spans):
        image_of_key[s:e] = i
    hidden = (image_of_key[None, :] >= 0) & (image_of_key[None, :] < hidden_below[:, None])
    return causal & ~hidden
