"""A training forward's attention by observation chunk, over the keys each chunk may see.

With ``generator.keep_last_k_images``, most keys of a long episode are images hidden from
most queries: a 32-turn ``maze_2d/easy`` episode of about 3,900 tokens holds 32 frames of
100 tokens, each seen only by its own turn's tokens. Under the dense ``[L, L]`` visibility
mask (``clew.models.visibility``) attention computes every pair and masks nearly 90% of them
away, and on CUDA an arbitrary mask keeps SDPA on its memory-efficient kernel, which reads
the whole mask.

Here the queries go in blocks that share what they may see: the tokens of one run of equal
``hidden_below`` (one observation chunk and its reply), at most ``block`` at a time. A
block's keys are the positions up to its end that it may see (text, and images not hidden
from it), gathered into ``[blocks, kv_heads, K, D]`` (``K`` the most keys of any block); one
batched SDPA call per layer computes every block under a ``[blocks, 1, Q, K]`` mask that
is causal by position. The pairs computed are the blocks' own (about a seventh of the dense
square for 32-turn maze episodes), the result is the dense mask's up to float rounding, and
the layout is a ``PackedLayout`` whose one group names its keys apart from its queries
(``clew.models.packed_attention``: the forward runs inside ``packed_attention``). The mask
is built on the device from the blocks' positions, a few numbers a block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from clew.models.packed_attention import PackedLayout, QueryGroup

__all__ = ["BLOCK", "turn_layout"]

BLOCK = 128  # most queries a block: a long run (the first chunk's instructions) is split
_NO_KEY = 1 << 40  # a padded key's position: after every query, so masked for all


def _blocks(hidden_below: np.ndarray, block: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each query block of one sequence: runs of equal ``hidden_below``,
    split every ``block`` tokens."""
    n = len(hidden_below)
    bounds = [0, *(np.flatnonzero(np.diff(hidden_below)) + 1).tolist(), n]
    return [
        (s, min(s + block, e))
        for a, e in zip(bounds[:-1], bounds[1:], strict=True)
        for s in range(a, e, block)
    ]


def _visible_counts(
    below: np.ndarray, image: np.ndarray, row: np.ndarray, start: np.ndarray, end: np.ndarray
) -> np.ndarray:
    """How many keys each block sees: the positions before its end less the image tokens
    hidden from it. Image ids rise along a row, so the hidden ones are a row's first
    image tokens, as many as have an id below the block's ``hidden_below``."""
    counts = np.empty(len(row), dtype=np.int64)
    for b in np.unique(row):
        at = np.flatnonzero(row == b)
        ids = image[b][image[b] >= 0]  # the row's image tokens' ids, ascending
        before = np.concatenate([[0], np.cumsum(image[b] >= 0)])[end[at]]
        hidden = np.searchsorted(ids, below[b, start[at]], side="left")
        counts[at] = end[at] - np.minimum(before, hidden)
    return counts


def turn_layout(
    hidden_below: Tensor,
    image_of_key: Tensor,
    lengths: Sequence[int],
    device: torch.device | str = "cpu",
    block: int = BLOCK,
) -> PackedLayout:
    """The attention layout of right-padded rows ``[B, W]`` with their visibility vectors
    (``clew.models.visibility.hiding_vectors``) and real ``lengths``: query blocks and the
    keys each sees (module docstring). Positions past a row's length get a zero output.

    The blocks and their key counts are planned on the host, a few numbers a block; which
    keys those are is found on the device (a stable sort of each block's visible
    positions to the front), so nothing is read back from it."""
    rows, width = hidden_below.shape
    below, image = hidden_below.numpy(), image_of_key.numpy()
    spans = [(b, s, e) for b, n in enumerate(lengths) for s, e in _blocks(below[b, :n], block)]
    row, start, end = (np.array(x, dtype=np.int64) for x in zip(*spans, strict=True))
    count = len(spans)
    counts = _visible_counts(below, image, row, start, end)
    k_len = int(counts.max())
    q_len = int((end - start).max())
    q_at = start[:, None] + np.arange(q_len)[None, :]
    real = q_at < end[:, None]
    q_index = np.where(real, row[:, None] * width + q_at, 0)
    q_pos = np.where(real, q_at, width)  # padding queries see every key: finite, unread
    order = np.empty(rows * width, dtype=np.int64)
    covered = np.zeros(rows * width, dtype=bool)
    order[q_index[real]] = np.flatnonzero(real.reshape(-1))
    covered[q_index[real]] = True
    padding = np.flatnonzero(~covered)
    order[padding] = count * q_len + np.arange(len(padding))

    def dev(x: np.ndarray | Tensor) -> Tensor:
        x = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
        return x.to(device, non_blocking=True)

    row_d, hides = dev(row), dev(below[row, start])
    img = dev(image_of_key)[row_d]  # [blocks, W]
    pos = torch.arange(width, device=img.device)
    seen = (pos[None, :] < dev(end)[:, None]) & ((img < 0) | (img >= hides[:, None]))
    cols = torch.argsort((~seen).to(torch.int8), dim=1, stable=True)[:, :k_len]
    real_key = torch.arange(k_len, device=img.device)[None, :] < dev(counts)[:, None]
    k_pos = torch.where(real_key, cols, _NO_KEY)
    mask = (k_pos[:, None, :] <= dev(q_pos)[:, :, None])[:, None]  # [blocks, 1, Q, K]
    group = QueryGroup(index=dev(q_index), mask=mask, keys=row_d[:, None] * width + cols)
    return PackedLayout(rows, width, [group], dev(order), len(padding))
