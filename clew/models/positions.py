"""Multimodal RoPE positions (Qwen-VL's M-RoPE) for a chunk of tokens.

Text tokens advance one position on all three axes; an image's tokens share the temporal
position and spread over height and width, and the text after it resumes past the image's
largest extent. transformers recomputes this for the whole sequence in a Python loop over
the batch at every call; clew computes it once per appended chunk, from where the sequence
stood, which is what lets the engine extend cached sequences turn by turn. The consistency
test checks these positions against transformers' own ``get_rope_index``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch


def mrope_positions(
    token_ids: list[int],
    image_grid_thw: torch.Tensor | None,
    start: int,
    image_token_id: int,
    merge_size: int,
) -> tuple[torch.Tensor, int]:
    """Positions ``[3, len(token_ids)]`` of a chunk that starts at ``start``, and the next start."""
    ids = np.asarray(token_ids, dtype=np.int64)
    image_at = np.flatnonzero(ids == image_token_id)
    grids = tuple(map(tuple, image_grid_thw.tolist())) if image_grid_thw is not None else ()
    # A rollout's chunks repeat a handful of layouts (same length, same image block), so
    # the layout's relative positions are computed once and shifted by ``start``.
    rel, span = _relative_positions(len(ids), image_at.tobytes(), grids, merge_size)
    return torch.from_numpy(rel + start), start + span


@lru_cache(maxsize=4096)
def _relative_positions(
    n: int, image_at_bytes: bytes, grids: tuple[tuple[int, ...], ...], merge_size: int
) -> tuple[np.ndarray, int]:
    image_at = np.frombuffer(image_at_bytes, dtype=np.int64)
    pos = np.empty((3, n), dtype=np.int64)
    # Whole runs at a time (text between images, then one image's block): a per-token loop
    # was a visible host cost for a batch of SFT demonstrations.
    i, p, k = 0, 0, 0
    for t, h, w in grids:
        if k >= len(image_at):
            break
        first = int(image_at[k])
        pos[:, i:first] = p + np.arange(first - i)
        p += first - i
        h, w = h // merge_size, w // merge_size
        count = t * h * w
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pos[:, first : first + count] = p + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        p += max(t, h, w)
        i, k = first + count, k + count
    if k != len(image_at):
        raise ValueError(
            f"{len(image_at)} image tokens but the image grids account for {k}: the chunk and "
            "its image_grid_thw do not match"
        )
    pos[:, i:n] = p + np.arange(n - i)
    p += n - i
    pos.setflags(write=False)
    return pos, p


def sequence_positions(
    token_ids: list[int], image_grid_thw: torch.Tensor | None, image_token_id: int, merge_size: int
) -> torch.Tensor:
    """Positions ``[3, L]`` of a whole sequence (a chunk starting at 0)."""
    return mrope_positions(token_ids, image_grid_thw, 0, image_token_id, merge_size)[0]
