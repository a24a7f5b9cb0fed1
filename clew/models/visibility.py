"""Which images a token may attend to when only the last K images stay in context.

With ``generator.keep_last_k_images = K``, from the turn that brings image ``m`` on, images
older than ``m - K + 1`` are hidden from every later token. The engine hides them by
masking their KV-cache columns (their keys stay in memory but receive no attention); the
trainer must reproduce exactly what each token saw, so it builds the same visibility as
a 4D attention mask from where each observation chunk started.

A token's *epoch* is the observation chunk it was fed with: the tokens of chunk ``j`` and
the reply that follows it, except the reply's last token, which the engine feeds at the
start of chunk ``j + 1`` (it is sampled last and fed with the next observation).

The same visibility also comes as FlexAttention's block mask (``visibility_block_mask``),
computed from the vectors a block at a time instead of held as ``[B, W, W]`` entries, so
that attention skips the blocks no query of it sees (``trainer.flex_attention``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


def _run_starts(token_ids: list[int], image_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Bool ``[L]`` each: which tokens are image placeholders, and which begin a run of them."""
    is_image = np.asarray(token_ids, dtype=np.int64) == image_token_id
    return is_image, is_image & ~np.concatenate([[False], is_image[:-1]])


def image_spans(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of image placeholder tokens, in order."""
    is_image, _ = _run_starts(token_ids, image_token_id)
    edges = np.flatnonzero(np.diff(is_image.astype(np.int8), prepend=0, append=0))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def hiding_vectors(
    token_ids: list[int], chunk_starts: list[int], image_token_id: int, keep_last_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Long ``[L]`` each: per query, the image index below which images are hidden from it;
    per key, the image it belongs to (-1 for text). ``visibility_from_vectors`` expands them."""
    n = len(token_ids)
    is_image, run_starts = _run_starts(token_ids, image_token_id)
    if not run_starts.any():
        return torch.zeros(n, dtype=torch.long), torch.full((n,), -1, dtype=torch.long)
    starts = np.asarray(chunk_starts, dtype=np.int64)
    epoch = np.searchsorted(starts, np.arange(1, n + 1), side="right") - 1
    # Images fed up to and including each epoch (a chunk's images lie inside it).
    image_epoch = np.searchsorted(starts, np.flatnonzero(run_starts), side="right") - 1
    images_upto = np.searchsorted(image_epoch, np.arange(len(starts)), side="right")
    hidden_below = images_upto[np.clip(epoch, 0, None)] - keep_last_k
    image_of_key = np.where(is_image, np.cumsum(run_starts) - 1, -1)
    return torch.from_numpy(hidden_below), torch.from_numpy(image_of_key)


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


def visibility_block_mask(
    lengths: torch.Tensor,
    width: int,
    hidden_below: torch.Tensor | None = None,
    image_of_key: torch.Tensor | None = None,
    document: torch.Tensor | None = None,
) -> BlockMask:
    """FlexAttention's block mask over ``[B, W]`` rows (``W = width``) whose real lengths are
    ``lengths [B]``, on their device: each query sees its causal past among its row's real
    keys, minus the images hidden from it (``hidden_below`` / ``image_of_key``, both or
    neither) and, with ``document``, the keys of other sequences packed in its row.

    Real queries see what ``visibility_from_vectors`` lets them see. Unlike there, a padded
    query of a packed row sees nothing (FlexAttention gives it a zero output), which no real
    position reads. On CUDA the mask is built by a compiled kernel, never whole.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    if (hidden_below is None) != (image_of_key is None):
        raise ValueError("hidden_below and image_of_key come together, or neither")

    def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        seen = (k <= q) & (k < lengths[b])
        if hidden_below is not None and image_of_key is not None:
            image = image_of_key[b, k]
            seen = seen & ((image < 0) | (image >= hidden_below[b, q]))
        if document is not None:
            seen = seen & (document[b, q] == document[b, k])
        return seen

    device = lengths.device
    rows = lengths.shape[0]
    return create_block_mask(
        visible, rows, None, width, width, device=device, _compile=device.type == "cuda"
    )
