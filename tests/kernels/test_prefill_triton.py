"""clew's Triton prefill kernel (``prefill_attention=triton``, ``clew.kernels.prefill_triton``):
the attention of the masked prefill for every real token, whatever the blocks, and the same
samples from an engine. On a CPU Triton's interpreter runs the kernel."""

from __future__ import annotations

import pytest
import torch
from support.engine_cases import (
    chunk_case,
    eight_b_case,
    play_with_prefill,
)
from support.rollout_cases import assert_same_samples

from clew.config import load_config
from clew.config.settings import engine_options
from clew.errors import ConfigError
from clew.inference import attention as attention_module
from clew.inference.attention import gqa_sdpa_attention, text_config
from clew.inference.engine import resolve_prefill_attention
from clew.kernels.prefill_triton import prefill_triton
from clew.kernels.slot_views import prefill_lengths

pytest.importorskip("triton")


def _masked(query, key, value, lengths):
    """The masked reference of a left-padded chunk: query ``j`` of row ``r`` sees columns
    up to ``lengths[r] - T + j``."""
    t, width = query.shape[2], key.shape[2]
    limit = lengths[:, None] - t + torch.arange(t)[None, :]  # [rows, T]
    mask = torch.arange(width)[None, None, :] <= limit[:, :, None]
    return gqa_sdpa_attention(None, query, key, value, mask[:, None])[0]


def test_the_kernel_computes_the_masked_prefill_for_every_real_token():
    query, key, value, lengths, mask, real = chunk_case()
    expected, _ = gqa_sdpa_attention(None, query, key, value, mask)
    got = prefill_triton(query, key, value, lengths, interpret=True)
    assert got.shape == expected.shape
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
    # The middle row's first padding queries see no column: zeros, no NaN.
    assert torch.isfinite(got).all() and got[1, :3].abs().max() == 0
    with prefill_lengths(lengths, "triton"):
        inside, _ = gqa_sdpa_attention(None, query, key, value, torch.zeros_like(mask))
    torch.testing.assert_close(inside, got)


@pytest.mark.parametrize(
    "group, block_m, block_n", [(4, 16, 16), (4, 32, 8), (4, 64, 64), (3, 16, 8), (7, 32, 16)]
)
def test_blocks_that_split_positions_and_columns_anywhere_give_the_same_attention(
    group, block_m, block_n
):
    # 13 positions of `group` query heads a KV head: a block of 16 or 32 (position, head)
    # pairs ends inside a position's heads where the group does not divide it (3, 7); the
    # columns fall into the unmasked loop, the masked loop, or both, depending on the row.
    gen = torch.Generator().manual_seed(1)
    rows, kv_heads, t, d, cap = 3, 2, 13, 16, 40
    query = torch.randn(rows, t, kv_heads * group, d, generator=gen).transpose(1, 2)
    keys, values = (torch.randn(rows, kv_heads, cap, d, generator=gen) for _ in range(2))
    lengths = torch.tensor([13, 40, 20])
    got = prefill_triton(
        query, keys, values, lengths, block_m=block_m, block_n=block_n, interpret=True
    )
    expected = _masked(query, keys, values, lengths)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_bf16_prefill_is_computed_in_float32_by_the_interpreter():
    query, key, value, lengths, mask, real = chunk_case(dtype=torch.bfloat16)
    got = prefill_triton(query, key, value, lengths, interpret=True)
    assert got.dtype == torch.bfloat16
    expected, _ = gqa_sdpa_attention(None, query.float(), key.float(), value.float(), mask)
    torch.testing.assert_close(got[real].float(), expected[real], atol=1e-2, rtol=1e-2)


def test_heads_that_do_not_share_kv_heads_evenly_are_refused():
    q, k = torch.randn(1, 6, 2, 16), torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match="6 query heads cannot share 4 KV heads"):
        prefill_triton(q, k, k, torch.tensor([4]), interpret=True)


def test_auto_takes_the_kernel_on_cuda_only_and_a_missing_triton_is_refused(monkeypatch):
    assert resolve_prefill_attention("auto", torch.device("cuda")) == "triton"
    assert resolve_prefill_attention("auto", torch.device("cpu")) == "varlen"
    assert resolve_prefill_attention("sdpa", torch.device("cuda")) == "sdpa"
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert resolve_prefill_attention("auto", torch.device("cuda")) == "varlen"
    with pytest.raises(ConfigError, match="prefill_attention=triton runs clew's Triton kernel"):
        resolve_prefill_attention("triton", torch.device("cpu"))


def test_the_config_key_takes_triton():
    cfg = load_config(None, ["generator.inference_engine.prefill_attention=triton"])
    assert engine_options(cfg).prefill_attention == "triton"


def test_an_engine_with_the_triton_prefill_samples_what_the_masked_prefill_samples(
    maze_policy,
    monkeypatch,
):
    model, chat, rows = maze_policy
    calls: list[int] = []
    inner = attention_module.prefill_triton

    def recording(query, key, value, lengths, scale=None, **kw):
        calls.append(query.shape[2])
        return inner(query, key, value, lengths, scale, **kw)

    monkeypatch.setattr(attention_module, "prefill_triton", recording)
    triton_run = play_with_prefill(model, chat, rows, "triton")
    plain = play_with_prefill(model, chat, rows, "sdpa")
    layers = text_config(model).num_hidden_layers
    assert calls and len(calls) % layers == 0  # whole forwards took the kernel
    assert_same_samples(triton_run, plain, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4, 96])
def test_the_compiled_kernel_matches_flash_attention_at_the_8b_shape(rows):
    # Qwen3-VL-8B's attention (32 query heads over 8 KV heads of 128) and a 15-turn
    # rollout's widths: chunks of 140 new columns over rows of 150-2000.
    from clew.kernels.prefill_varlen import varlen_prefill

    query, keys, values, lengths = eight_b_case(rows)
    got = prefill_triton(query, keys, values, lengths)
    flash = varlen_prefill(query, keys, values, lengths)
    torch.testing.assert_close(got.float(), flash.float(), atol=2e-2, rtol=2e-2)
