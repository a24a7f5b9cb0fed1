"""clew.kernels.split_decode: the split-KV decode kernel, run by Triton's interpreter on a
CPU (and compiled on a GPU), against SDPA over each row's first ``length`` columns."""

from __future__ import annotations

import pytest
import torch

from clew.errors import ConfigError
from clew.kernels.split_decode import split_decode, splits_for


def _reference(q, k, v, lengths, scale):
    b, heads, _, d = q.shape
    kv_heads = k.shape[1]
    live = torch.arange(k.shape[2], device=k.device)[None, :] < lengths[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(b, kv_heads, heads // kv_heads, d).float(), k.float(), v.float(),
        live[:, None, None], scale=scale,
    )  # fmt: skip
    return out.reshape(b, 1, heads, d)


def _slot_views(b, kv_heads, heads, d, width, dtype, device="cpu"):
    """Query [B, H, 1, D] as transformers passes it (a transpose) and keys/values as views of
    larger slot buffers, as SlotCache hands them to the attention."""
    g = torch.Generator(device="cpu").manual_seed(0)
    bufs = [torch.randn(b + 2, kv_heads, width + 40, d, generator=g) for _ in range(2)]
    k, v = (x.to(device, dtype)[1 : 1 + b, :, :width] for x in bufs)
    q = torch.randn(b, 1, heads, d, generator=g).to(device, dtype).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize(
    ("splits", "head_dim"), [(1, 32), (3, 32), (4, 48)], ids=["one-split", "three", "dim48"]
)
def test_each_row_attends_to_its_first_length_columns_as_sdpa_does(splits, head_dim):
    q, k, v = _slot_views(b=5, kv_heads=2, heads=8, d=head_dim, width=200, dtype=torch.float32)
    # A row of one column, a full row, and rows shorter than a split's share (empty splits).
    lengths = torch.tensor([1, 200, 77, 130, 5])
    out = split_decode(q, k, v, lengths, 0.125, splits=splits, block_n=32, interpret=True)
    assert out.shape == (5, 1, 8, head_dim)
    torch.testing.assert_close(out, _reference(q, k, v, lengths, 0.125), atol=1e-5, rtol=1e-5)


def test_columns_past_a_row_s_length_change_nothing():
    q, k, v = _slot_views(b=3, kv_heads=1, heads=4, d=32, width=96, dtype=torch.float32)
    lengths = torch.tensor([40, 96, 10])
    before = split_decode(q, k, v, lengths, None, splits=2, block_n=32, interpret=True)
    k[0, :, 40:], v[2, :, 10:] = 1e4, float("nan")  # what a row must not read
    after = split_decode(q, k, v, lengths, None, splits=2, block_n=32, interpret=True)
    torch.testing.assert_close(after, before)


def test_a_bf16_cache_is_computed_in_float32_by_the_interpreter():
    q, k, v = _slot_views(b=2, kv_heads=1, heads=2, d=32, width=64, dtype=torch.bfloat16)
    lengths = torch.tensor([64, 33])
    out = split_decode(q, k, v, lengths, None, interpret=True)
    assert out.dtype == torch.bfloat16
    ref = _reference(q, k, v, lengths, 32**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_shapes_the_kernel_does_not_take_are_refused_with_what_it_takes():
    q, k, v = _slot_views(b=2, kv_heads=1, heads=2, d=32, width=64, dtype=torch.float32)
    with pytest.raises(ValueError, match="one query a row"):
        split_decode(q.expand(2, 2, 3, 32), k, v, torch.tensor([3, 3]), interpret=True)
    with pytest.raises(ValueError, match="3 query heads over 2 KV heads"):
        split_decode(q[:, :1].expand(2, 3, 1, 32), k.expand(2, 2, 64, 32), v, torch.tensor([3, 3]))


def test_a_cpu_takes_one_split():
    assert splits_for(4, torch.device("cpu")) == 1


def test_the_engine_refuses_triton_attention_without_the_triton_package(monkeypatch):
    import importlib.util

    from clew.inference.engine import InferenceEngine

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    with pytest.raises(ConfigError, match="pip install triton.*decode_attention=varlen"):
        InferenceEngine(torch.nn.Linear(1, 1), None, decode_attention="triton")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_default_engine_takes_the_triton_kernel_and_fused_pointwise_on_cuda_only(
    device, tmp_path
):
    from clew.inference.engine import InferenceEngine
    from clew.models import build_model
    from clew.models.chat import ChatFormat

    built = build_model("tiny", tmp_path, overwrite=True)
    engine = InferenceEngine(built.model.to(device), ChatFormat(built.processor))
    on_cuda = device == "cuda"
    assert engine.decode_attention == ("triton" if on_cuda else "varlen")
    assert engine.fused_pointwise is on_cuda


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 96, 192])
def test_the_compiled_kernel_matches_sdpa_in_bf16_at_the_8b_shape(rows):
    q, k, v = _slot_views(
        b=rows, kv_heads=8, heads=32, d=128, width=800, dtype=torch.bfloat16, device="cuda"
    )
    lengths = torch.randint(1, 801, (rows,), device="cuda")
    out = split_decode(q, k, v, lengths, 128**-0.5)
    ref = _reference(q, k, v, lengths, 128**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
