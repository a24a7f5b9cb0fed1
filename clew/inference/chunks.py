"""A turn's chunks as one prefill forward's arrays: rows left-padded to one width.

Every row's last real token is the last column, so one logit row per sequence comes out of
the forward. Built in numpy and handed to the device once: per-row tensor ops were a
visible share of a GPU turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from clew.models.chat import ChatFormat, Chunk


@dataclass
class Prefill:
    """One forward's worth of a turn's chunks: rows ``[lo, hi)``, left-padded."""

    lo: int
    hi: int
    ids: np.ndarray  # [rows, T]
    pos: np.ndarray  # [3, rows, T]
    mask: np.ndarray  # [rows, T], 1 on real tokens
    image: np.ndarray  # [rows, T], the image (per sequence) a column holds, -1 for text
    counts: list[int]
    pixels: list[torch.Tensor]
    grids: list[torch.Tensor]


def pack(
    chat: ChatFormat,
    token_lists: list[list[int]],
    pos_lists: list[torch.Tensor | int],
    chunks: list[Chunk],
    images_seen: list[int],
    lo: int,
    width_step: int = 1,
) -> tuple[Prefill, list[int]]:
    """The rows ``lo, lo + 1, ...``'s new tokens (``token_lists``, their M-RoPE positions
    ``pos_lists``, from ``chunks``) left-padded to one width, a multiple of ``width_step``
    (a few widths, for forwards replayed from CUDA graphs captured per width), and each row's
    count of images seen after them (``images_seen`` before)."""
    b = len(token_lists)
    width = -(-max(len(t) for t in token_lists) // width_step) * width_step
    ids_np = np.full((b, width), chat.pad_id, dtype=np.int64)
    pos_np = np.zeros((3, b, width), dtype=np.int64)
    mask_np = np.zeros((b, width), dtype=np.int64)
    for i, (ids, pos) in enumerate(zip(token_lists, pos_lists, strict=True)):
        n = len(ids)
        ids_np[i, width - n :] = ids
        pos_np[:, i, width - n :] = pos if isinstance(pos, int) else pos.numpy()
        mask_np[i, width - n :] = 1
    # Which image (counted per sequence) each new column holds: runs of image tokens.
    is_image = (ids_np == chat.image_token_id) & (mask_np == 1)
    starts = is_image & ~np.concatenate([np.zeros((b, 1), dtype=bool), is_image[:, :-1]], 1)
    seen = np.asarray(images_seen, dtype=np.int64)[:, None]
    image_np = np.where(is_image, seen + np.cumsum(starts, 1) - 1, -1)
    pixels = [c.pixel_values for c in chunks if c.pixel_values is not None]
    grids = [c.image_grid_thw for c in chunks if c.pixel_values is not None]
    counts = [len(t) for t in token_lists]
    part = Prefill(lo, lo + b, ids_np, pos_np, mask_np, image_np, counts, pixels, grids)
    return part, (seen[:, 0] + starts.sum(1)).tolist()
