"""Multimodal RoPE positions (Qwen-VL's M-RoPE) for a chunk of tokens.

Text tokens advance one position on all three axes; an image's tokens share the temporal
position and spread over height and width, and the text after it resumes past the image's
largest extent. transformers recomputes this for the whole sequence in a Python loop over
the batch at every call; clew computes it once per appended chunk, from where the sequence
stood, which is what lets the engine extend cached sequences turn by turn. The consistency
test checks these positions against transformers' own ``get_rope_index``.
"""

from __future__ import annotations

import torch


def mrope_positions(
    token_ids: list[int],
    image_grid_thw: torch.Tensor | None,
    start: int,
    image_token_id: int,
    merge_size: int,
) -> tuple[torch.Tensor, int]:
    """Positions ``[3, len(token_ids)]`` of a chunk that starts at ``start``, and the next start."""
    n = len(token_ids)
    pos = torch.empty(3, n, dtype=torch.long)
    grids = iter(image_grid_thw.tolist()) if image_grid_thw is not None else iter(())
    i, p = 0, start
    while i < n:
        if token_ids[i] != image_token_id:
            pos[:, i] = p
            p += 1
            i += 1
            continue
        t, h, w = next(grids)
        h, w = h // merge_size, w // merge_size
        count = t * h * w
        tt = torch.arange(t).view(-1, 1, 1).expand(t, h, w).reshape(-1)
        hh = torch.arange(h).view(1, -1, 1).expand(t, h, w).reshape(-1)
        ww = torch.arange(w).view(1, 1, -1).expand(t, h, w).reshape(-1)
        pos[0, i : i + count] = p + tt
        pos[1, i : i + count] = p + hh
        pos[2, i : i + count] = p + ww
        p += max(t, h, w)
        i += count
    return pos, p


def sequence_positions(
    token_ids: list[int], image_grid_thw: torch.Tensor | None, image_token_id: int, merge_size: int
) -> torch.Tensor:
    """Positions ``[3, L]`` of a whole sequence (a chunk starting at 0)."""
    return mrope_positions(token_ids, image_grid_thw, 0, image_token_id, merge_size)[0]
