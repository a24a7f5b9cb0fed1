"""A turn's prefill reading each row's own columns (``prefill_attention=varlen``,
``clew.kernels.prefill_varlen.varlen_prefill``): the same attention as the masked prefill for
every real token, the same samples from an engine, rows joining a running batch included."""

from __future__ import annotations

import re

import pytest
import torch
from rollout_support import assert_same_samples, ending_at_different_turns

from clew.config import load_config
from clew.data.rows import generate_rows
from clew.errors import ConfigError
from clew.inference import attention as attention_module
from clew.inference.attention import gqa_sdpa_attention, text_config
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.kernels.prefill_varlen import _varlen_reference, varlen_prefill
from clew.kernels.slot_views import prefill_lengths, varlen_index
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat, Chunk
from clew.rollout.loop import RolloutSettings, play

KV_HEADS, GROUP, D, CAP = 2, 3, 8, 16


def _chunk_case(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """Slot buffers of 4 slots, a prefill of rows in slots 1-3 (left-padded to T = 5 new
    columns): each row's lengths after the chunk, its real tokens and the masked reference's
    mask, as ``SlotCache.prefill`` builds it."""
    gen = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(4, KV_HEADS, CAP, D, generator=gen) for _ in range(2))
    first, t = 1, 5
    fill = torch.tensor([6, 0, 9])  # columns written before the chunk
    new = torch.tensor([5, 2, 3])  # real tokens in the chunk (the last columns of its T)
    lengths = fill + new
    query = torch.randn(3, KV_HEADS * GROUP, t, D, generator=gen)
    real = torch.arange(t)[None, :] >= (t - new)[:, None]  # [rows, T]
    col = fill[:, None] + torch.arange(t)[None, :] - (t - new)[:, None]  # a real token's column
    width = int(lengths.max())
    causal = torch.arange(width)[None, None, :] <= col[:, :, None]
    visible = torch.arange(width)[None, None, :] < lengths[:, None, None]
    mask = (causal & visible)[:, None]  # [rows, 1, T, width]
    cast = {"device": device, "dtype": dtype}
    k, v = (x.to(**cast)[first : first + 3, :, :width] for x in (keys, values))
    return query.to(**cast), k, v, lengths.to(device), mask.to(device), real


def test_each_row_attends_to_its_own_columns_as_under_the_prefill_mask():
    query, key, value, lengths, mask, real = _chunk_case()
    expected, _ = gqa_sdpa_attention(None, query, key, value, mask)  # [rows, T, H, D]
    got = varlen_prefill(query, key, value, lengths)
    assert got.shape == expected.shape
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
    # The middle row's first three padding queries see no column (2 - 5 + j < 0): zeros,
    # so no NaN reaches anything.
    assert torch.isfinite(got).all()
    # Inside the block the engine's attention function takes this path and drops the mask.
    with prefill_lengths(lengths):
        inside, _ = gqa_sdpa_attention(None, query, key, value, torch.zeros_like(mask))
    torch.testing.assert_close(inside, got)


def test_a_query_with_no_column_gets_zero():
    q = torch.randn(1 * 4, 2, D)  # one row of 4 queries, 2 heads over 1 KV head
    k, v = torch.randn(CAP, 1, D), torch.randn(CAP, 1, D)
    out = _varlen_reference(q, k, v, torch.tensor([2]), torch.tensor([0, CAP]), 4, CAP, None)
    # Bottom-right causal: query j sees columns up to 2 - 4 + j, so the first two see none.
    assert out[:2].abs().max() == 0 and out[2:].abs().min() > 0


def test_a_prefill_builds_its_kernel_index_once_for_every_layer():
    lengths = torch.tensor([4, 7])
    seqlens, cu_q, cu_k = varlen_index(lengths, kv_heads=2, cap=8, group=5)
    assert seqlens.tolist() == [4, 4, 7, 7] and cu_q.tolist() == [0, 5, 10, 15, 20]
    with prefill_lengths(lengths):
        first = varlen_index(lengths, 2, 8, 5)
        assert all(a is b for a, b in zip(first, varlen_index(lengths, 2, 8, 5), strict=True))
    assert varlen_index(lengths, 2, 8, 5)[0] is not first[0]


def test_an_unknown_prefill_attention_is_refused_with_the_choices(policy):
    model, chat, _ = policy
    with pytest.raises(ConfigError, match="prefill_attention='flash'.*sdpa, varlen"):
        InferenceEngine(model, chat, prefill_attention="flash")


def test_the_config_key_reaches_the_engine_options_and_a_typo_lists_the_choices():
    from clew.config.settings import engine_options

    cfg = load_config(None, ["generator.inference_engine.prefill_attention=sdpa"])
    assert engine_options(cfg).prefill_attention == "sdpa"
    assert engine_options(load_config(None, [])).prefill_attention == "auto"
    # The dynamic cache has no slots to read by lengths: its default is masked SDPA.
    dynamic = load_config(None, ["generator.inference_engine.kv_cache=dynamic"])
    assert engine_options(dynamic).prefill_attention == "sdpa"
    from clew.trainer.pipeline import updated

    again = updated(load_config(None, []), {"generator.inference_engine.kv_cache": "dynamic"})
    assert engine_options(again).prefill_attention == "sdpa"  # a default follows the cache
    choices = "'auto' | 'sdpa' | 'varlen' | 'triton'"
    expected = re.escape(f"prefill_attention: expected {choices}, got 'flash'")
    with pytest.raises(ConfigError, match=expected):
        load_config(None, ["generator.inference_engine.prefill_attention=flash"])


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["prefill_attention=varlen", "kv_cache=dynamic"], "set kv_cache=static or prefill"),
        (["decode_attention=flash", "enforce_eager=true"], "enforce_eager=true takes none"),
        (["decode_attention=flex", "kv_cache=dynamic"], "kv_cache=dynamic takes none"),
    ],
)
def test_a_switch_another_key_turns_off_is_refused(overrides, says):
    keys = [f"generator.inference_engine.{o}" for o in overrides]
    with pytest.raises(ConfigError, match=r"\[engine-switch\].*" + re.escape(says)):
        load_config(None, keys)
    # The defaults with either key are fine (with the dynamic cache, a masked prefill).
    load_config(None, keys[1:])


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def policy(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    size, cell = {"qwen2_vl": (196, 28), "qwen3_vl": (224, 32)}[arch]  # 7 x 7 cells
    build_model("tiny", path, arch=arch, image_size=size, overwrite=True)
    model, processor = load_policy(path)
    model.eval()
    rows = generate_rows(
        "maze_2d/small", 3, env_options={"cell_px": cell, "action_format": "keyword"}
    )
    return model, ChatFormat(processor), rows


def _play(model, chat, rows, prefill: str, keep_last_k_images=None, temperature=1.0):
    settings = RolloutSettings(
        n_samples_per_prompt=3,
        max_turns=4,
        max_input_length=4096,
        sampling=SamplingParams(temperature=temperature, max_tokens=6),
        keep_last_k_images=keep_last_k_images,
        env_workers=1,  # ending_at_different_turns counts episodes in the order they start
    )
    engine = InferenceEngine(model, chat, prefill_attention=prefill)
    return play(engine, rows, settings, seed=3, env_factory=ending_at_different_turns())


@pytest.mark.parametrize("keep_last", [None, 1], ids=["all-images", "last-image"])
def test_a_varlen_prefill_samples_what_the_masked_prefill_samples(policy, keep_last, monkeypatch):
    model, chat, rows = policy
    calls: list[tuple[list[int], int]] = []
    inner = attention_module.varlen_prefill

    def recording(query, key, value, lengths, scale=None):
        calls.append((lengths.tolist(), query.shape[2]))
        return inner(query, key, value, lengths, scale)

    monkeypatch.setattr(attention_module, "varlen_prefill", recording)
    varlen = _play(model, chat, rows, "varlen", keep_last)
    masked_calls = len(calls)
    plain = _play(model, chat, rows, "sdpa", keep_last)
    assert len(calls) == masked_calls  # the masked prefill never takes the path
    layers = text_config(model).num_hidden_layers
    assert masked_calls >= layers and masked_calls % layers == 0  # whole forwards
    if keep_last is None:  # every prefill forward, from the first turn's 9 prompts on
        assert len(calls[0][0]) == 9
        assert len({tuple(c[0]) for c in calls}) * layers == masked_calls
    assert_same_samples(varlen, plain, tol=1e-5)


def test_rows_joining_a_running_batch_are_prefilled_on_their_own_slots(policy, monkeypatch):
    model, chat, rows = policy
    rows_read: list[int] = []
    inner = attention_module.varlen_prefill

    def recording(query, key, value, lengths, scale=None):
        rows_read.append(key.storage_offset() // key.stride(0))  # the forward's first slot
        return inner(query, key, value, lengths, scale)

    monkeypatch.setattr(attention_module, "varlen_prefill", recording)
    from clew.envs import make

    prompts = []
    for row in rows[:2]:
        obs = make(row.env_id, **row.options()).reset(seed=row.seed)
        prompts.append(chat.user_turn(obs.text, obs.images, first=True))
    prompt, other = prompts
    params = SamplingParams(temperature=0.0, max_tokens=3)
    out = {}
    for prefill in ("sdpa", "varlen"):
        engine = InferenceEngine(model, chat, prefill_attention=prefill, stop_token_ids=(-1,))
        batch = engine.open_batch(2, seed=1, capacity_hint=512)
        short = chat.user_turn("left right up down", [], first=True)
        first = batch.extend_and_generate({0: prompt, 1: short}, params)
        (joined,) = batch.add_rows(1, tokens=512)
        # The running rows feed their pending token; the joining row's prompt is a second
        # forward over its own slot (``prefill(first=2)``).
        later = batch.extend_and_generate({0: Chunk([]), 1: Chunk([]), joined: other}, params)
        out[prefill] = [(g.token_ids, g.logprobs) for g in (*first.values(), *later.values())]
    assert set(rows_read) == {0, 2}  # the opening rows' forward, then the joining row's
    for (a_tokens, a_lp), (b_tokens, b_lp) in zip(out["varlen"], out["sdpa"], strict=True):
        assert a_tokens == b_tokens
        assert max(abs(x - y) for x, y in zip(a_lp, b_lp, strict=True)) < 1e-5


@pytest.mark.gpu
def test_flash_prefill_computes_what_the_reference_computes_on_the_gpu():
    query, key, value, lengths, mask, real = _chunk_case("cuda", torch.bfloat16)
    got = varlen_prefill(query, key, value, lengths)  # FlashAttention's kernel
    expected, _ = gqa_sdpa_attention(None, query.float(), key.float(), value.float(), mask)
    torch.testing.assert_close(got[real].float(), expected[real], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_flash_prefill_samples_what_the_masked_prefill_samples_on_the_gpu(tmp_path):
    from test_cuda_graphs import _assert_same_until_they_part, cuda_policy

    model, chat, rows = cuda_policy(tmp_path)
    flash = _play(model, chat, rows, "varlen", temperature=0.0)
    masked = _play(model, chat, rows, "sdpa", temperature=0.0)
    _assert_same_until_they_part(flash, masked, tol=5e-2)
