"""Attention by observation chunk (``clew.models.turn_attention``) gives the dense
visibility mask's attention (``clew.models.visibility``) over the blocks' own keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clew.models.packed_attention import packed_sdpa
from clew.models.turn_attention import turn_layout
from clew.models.visibility import hiding_vectors, visibility_from_vectors

IMAGE = 9


def _episode(turns: int, image: int, text: int, first_text: int) -> tuple[list[int], list[int]]:
    """Token ids of an episode of ``turns`` chunks (text, an image run, text) and where each
    chunk starts."""
    ids, starts = [], []
    for t in range(turns):
        starts.append(len(ids))
        ids += [1] * (first_text if t == 0 else text) + [IMAGE] * image + [2] * text
    return ids, starts


def _rows(
    episodes: list[tuple[list[int], list[int]]],
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The episodes' visibility vectors (keep_last_k=1) as right-padded rows, and their
    lengths."""
    width = max(len(ids) for ids, _ in episodes)
    hb = torch.zeros(len(episodes), width, dtype=torch.long)
    img = torch.full((len(episodes), width), -1, dtype=torch.long)
    for b, (ids, starts) in enumerate(episodes):
        below, image = hiding_vectors(ids, starts, IMAGE, keep_last_k=1)
        hb[b, : len(ids)], img[b, : len(ids)] = below, image
    return hb, img, [len(ids) for ids, _ in episodes]


def _dense_reference(q, k, v, hidden_below, image_of_key, lengths, scale):
    lengths = torch.tensor(lengths, device=hidden_below.device)
    allowed = visibility_from_vectors(hidden_below, image_of_key, lengths)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, allowed, scale=scale).transpose(1, 2)


def test_blocks_over_their_own_keys_give_the_dense_visibility_mask_s_attention():
    gen = torch.Generator().manual_seed(0)
    hb, img, lengths = _rows([_episode(5, 6, 3, 20), _episode(2, 6, 3, 20), _episode(7, 6, 2, 20)])
    width = hb.shape[1]
    q = torch.randn(3, 4, width, 8, generator=gen)
    k, v = torch.randn(3, 2, width, 8, generator=gen), torch.randn(3, 2, width, 8, generator=gen)
    layout = turn_layout(hb, img, lengths, block=8)  # the first chunks split into blocks
    assert len(layout.groups) == 1 and layout.groups[0].keys is not None
    blocks, keys = layout.groups[0].keys.shape
    assert keys < width  # every block reads fewer keys than the longest row holds
    out, _ = packed_sdpa(torch.nn.Module(), q, k, v, None, scaling=0.3, packed_layout=layout)
    want = _dense_reference(q, k, v, hb, img, lengths, 0.3)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(out[b, :n], want[b, :n])
        assert not out[b, n:].any()  # padding positions: zero
    assert layout.calls == 1


def test_a_chunk_with_two_images_hides_its_first_from_the_tokens_after_its_second():
    # keep_last_k=1 and two images in one chunk: the chunk's own first image is hidden from
    # the tokens once the second is in, as the dense mask says.
    ids = [1, 1, IMAGE, IMAGE, 2, IMAGE, IMAGE, 2, 2]
    below, image = hiding_vectors(ids, [0], IMAGE, keep_last_k=1)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, len(ids), 4, generator=gen) for _ in range(3))
    layout = turn_layout(below[None], image[None], [len(ids)])
    out, _ = packed_sdpa(torch.nn.Module(), q, k, v, None, packed_layout=layout)
    want = _dense_reference(q, k, v, below[None], image[None], [len(ids)], None)
    torch.testing.assert_close(out, want)


@pytest.mark.gpu
def test_on_cuda_in_bfloat16_the_blocks_give_the_dense_mask_s_attention():
    gen = torch.Generator().manual_seed(2)
    hb, img, lengths = _rows([_episode(12, 100, 20, 200), _episode(5, 100, 20, 200)])
    width = hb.shape[1]
    cast = {"device": "cuda", "dtype": torch.bfloat16}
    q = torch.randn(2, 6, width, 64, generator=gen).to(**cast)
    k, v = (torch.randn(2, 2, width, 64, generator=gen).to(**cast) for _ in range(2))
    layout = turn_layout(hb, img, lengths, device="cuda")
    out, _ = packed_sdpa(torch.nn.Module(), q, k, v, None, packed_layout=layout)
    want = _dense_reference(q, k, v, hb.cuda(), img.cuda(), lengths, None)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(out[b, :n].float(), want[b, :n].float(), atol=2e-2, rtol=2e-2)
