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


def hiding_vectors(
    token_ids: list[int], chunk_starts: list[int], image_token_id: int, keep_last_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Long ``[L]`` each: per query, the image index below which images are hidden from it;
    per key, the image it belongs to (-1 for text). ``visibility_from_vectors`` expands them."""
    n = len(token_ids)
    image_of_key = torch.full((n,), -1, dtype=torch.long)
    spans = image_spans(token_ids, image_token_id)
    if not spans:
        return torch.zeros(n, dtype=torch.long), image_of_key
    starts = torch.tensor(chunk_starts, dtype=torch.long)
    positions = torch.arange(n)
    epoch = torch.searchsorted(starts, positions + 1, right=True) - 1
    # Images fed up to and including each epoch (a chunk's images lie inside it).
    image_epoch = torch.searchsorted(starts, torch.tensor([s for s, _ in spans]), right=True) - 1
    images_upto = torch.stack([(image_epoch <= e).sum() for e in range(len(chunk_starts))])
    hidden_below = images_upto[epoch.clamp(min=0)] - keep_last_k
    for i, (s, e) in enumerate(spans):
        image_of_key[s:e] = i
    return hidden_below, image_of_key


def visibility_from_vectors(
    hidden_below: torch.Tensor,
    image_of_key: torch.Tensor,
    lengths: torch.Tensor,
    document: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``[B, 1, W, W]`` from ``[B, W]`` vectors (right-padded) and real ``lengths [B]``.

    Built where the vectors live (on the GPU for training): a mask of ``B * W * W`` entries
    is far more to build and move on the host than the ``B * W`` numbers it comes from.
    Real queries see their causal past minus hidden images; padded queries see their row's
    real tokens, so no attention row is empty; nothing sees padded keys. ``document [B, W]``
    (rows packed with several sequences): a query sees only keys of its own sequence.
    """
    w = hidden_below.shape[1]
    pos = torch.arange(w, device=hidden_below.device)
    causal = pos[None, :] <= pos[:, None]  # [Wq, Wk]
    real_key = pos[None, :] < lengths[:, None]  # [B, Wk]
    keys = image_of_key[:, None, :]
    # In place where it can be: at training sizes each [B, Wq, Wk] temporary is a gigabyte.
    allowed = keys < hidden_below[:, :, None]  # [B, Wq, Wk]: hidden if the key is an image
    allowed &= keys >= 0
    allowed.logical_not_()
    allowed &= causal
    allowed &= real_key[:, None, :]
    if document is not None:
        allowed &= document[:, :, None] == document[:, None, :]
    padded_query = pos[None, :] >= lengths[:, None]  # [B, Wq]
    allowed[padded_query] = real_key[:, None, :].expand_as(allowed)[padded_query]
    return allowed[:, None]


def visibility_mask(
    token_ids: list[int], chunk_starts: list[int], image_token_id: int, keep_last_k: int
) -> torch.Tensor:
    """Bool ``[L, L]``: query ``q`` may attend to key ``k`` (causal, old images hidden)."""
    hidden_below, image_of_key = hiding_vectors(
        token_ids, chunk_starts, image_token_id, keep_last_k
    )
    n = torch.tensor([len(token_ids)])
    return visibility_from_vectors(hidden_below[None], image_of_key[None], n)[0, 0]
