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


def turn_layout(
    hidden_below: Tensor,
    image_of_key: Tensor,
    lengths: Sequence[int],
    device: torch.device | str = "cpu",
    block: int = BLOCK,
) -> PackedLayout:
    """The attention layout of right-padded rows ``[B, W]`` with their visibility vectors
    (``clew.models.visibility.hiding_vectors``) and real ``lengths``: query blocks and the
    keys each sees (module docstring). Positions past a row's length get a zero output."""
    rows, width = hidden_below.shape
    below, image = hidden_below.numpy(), image_of_key.numpy()
    queries: list[np.ndarray] = []
    keys: list[np.ndarray] = []
    for b, n in enumerate(lengths):
        hb, img = below[b, :n], image[b, :n]
        for s, e in _blocks(hb, block):
            seen = (img[:e] < 0) | (img[:e] >= hb[s])
            queries.append(b * width + np.arange(s, e))
            keys.append(b * width + np.flatnonzero(seen))
    q_len = max(len(q) for q in queries)
    k_len = max(len(k) for k in keys)
    count = len(queries)
    q_index = np.zeros((count, q_len), dtype=np.int64)
    k_index = np.zeros((count, k_len), dtype=np.int64)
    q_pos = np.full((count, q_len), width, dtype=np.int64)  # padding queries see every key
    k_pos = np.full((count, k_len), _NO_KEY, dtype=np.int64)
    order = np.empty(rows * width, dtype=np.int64)
    covered = np.zeros(rows * width, dtype=bool)
    for i, (q, k) in enumerate(zip(queries, keys, strict=True)):
        q_index[i, : len(q)], k_index[i, : len(k)] = q, k
        q_pos[i, : len(q)], k_pos[i, : len(k)] = q % width, k % width
        order[q] = i * q_len + np.arange(len(q))
        covered[q] = True
    padding = np.flatnonzero(~covered)
    order[padding] = count * q_len + np.arange(len(padding))
    to = {"device": device, "non_blocking": True}
    q_pos_d, k_pos_d = torch.from_numpy(q_pos).to(**to), torch.from_numpy(k_pos).to(**to)
    mask = (k_pos_d[:, None, :] <= q_pos_d[:, :, None])[:, None]  # [blocks, 1, Q, K]
    group = QueryGroup(
        index=torch.from_numpy(q_index).to(**to),
        mask=mask,
        keys=torch.from_numpy(k_index).to(**to),
    )
    return PackedLayout(rows, width, [group], torch.from_numpy(order).to(**to), len(padding))
