"""A turn's prefill reading each row's own columns (``prefill_attention=varlen``,
``clew.kernels.prefill_varlen.varlen_prefill``): the same attention as the masked prefill for
every real token, the same samples from an engine, rows joining a running batch included."""

from __future__ import annotations

import re

import pytest
import torch
from support.engine_cases import (
    CAP,
    D,
    assert_same_until_they_part,
    chunk_case,
    cuda_policy,
    play_with_prefill,
)
from support.rollout_cases import assert_same_samples

from clew.config import load_config
from clew.errors import ConfigError
from clew.inference import attention as attention_module
from clew.inference.attention import gqa_sdpa_attention, text_config
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.kernels.prefill_varlen import _varlen_reference, varlen_prefill
from clew.kernels.slot_views import prefill_lengths, varlen_index
from clew.models.chat import Chunk


def test_each_row_attends_to_its_own_columns_as_under_the_prefill_mask():
    query, key, value, lengths, mask, real = chunk_case()
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


def test_an_unknown_prefill_attention_is_refused_with_the_choices(maze_policy):
    model, chat, _ = maze_policy
    with pytest.raises(ConfigError, match="prefill_attention='paged'.*sdpa, varlen"):
        InferenceEngine(model, chat, prefill_attention="paged")


def test_the_config_key_reaches_the_engine_options_and_a_typo_lists_the_choices():
    from clew.config.settings import engine_options

    cfg = load_config(None, ["generator.inference_engine.prefill_attention=sdpa"])
    assert engine_options(cfg).prefill_attention == "sdpa"
    assert engine_options(load_config(None, [])).prefill_attention == "auto"
    choices = "'auto' | 'sdpa' | 'varlen' | 'triton'"
    expected = re.escape(f"prefill_attention: expected {choices}, got 'paged'")
    with pytest.raises(ConfigError, match=expected):
        load_config(None, ["generator.inference_engine.prefill_attention=paged"])


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["decode_attention=triton", "enforce_eager=true"], "enforce_eager=true takes none"),
    ],
)
def test_a_switch_another_key_turns_off_is_refused(overrides, says):
    keys = [f"generator.inference_engine.{o}" for o in overrides]
    with pytest.raises(ConfigError, match=r"\[engine-switch\].*" + re.escape(says)):
        load_config(None, keys)
    # The defaults with either key are fine.
    load_config(None, keys[1:])


@pytest.mark.parametrize("keep_last", [None, 1], ids=["all-images", "last-image"])
def test_a_varlen_prefill_samples_what_the_masked_prefill_samples(
    maze_policy, keep_last, monkeypatch
):
    model, chat, rows = maze_policy
    calls: list[tuple[list[int], int]] = []
    inner = attention_module.varlen_prefill

    def recording(query, key, value, lengths, scale=None):
        calls.append((lengths.tolist(), query.shape[2]))
        return inner(query, key, value, lengths, scale)

    monkeypatch.setattr(attention_module, "varlen_prefill", recording)
    varlen = play_with_prefill(model, chat, rows, "varlen", keep_last)
    masked_calls = len(calls)
    plain = play_with_prefill(model, chat, rows, "sdpa", keep_last)
    assert len(calls) == masked_calls  # the masked prefill never takes the path
    layers = text_config(model).num_hidden_layers
    assert masked_calls >= layers and masked_calls % layers == 0  # whole forwards
    if keep_last is None:  # every prefill forward, from the first turn's 9 prompts on
        assert len(calls[0][0]) == 9
        assert len({tuple(c[0]) for c in calls}) * layers == masked_calls
    assert_same_samples(varlen, plain, tol=1e-5)


def test_rows_joining_a_running_batch_are_prefilled_on_their_own_slots(maze_policy, monkeypatch):
    model, chat, rows = maze_policy
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
    query, key, value, lengths, mask, real = chunk_case("cuda", torch.bfloat16)
    got = varlen_prefill(query, key, value, lengths)  # FlashAttention's kernel
    expected, _ = gqa_sdpa_attention(None, query.float(), key.float(), value.float(), mask)
    torch.testing.assert_close(got[real].float(), expected[real], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_flash_prefill_samples_what_the_masked_prefill_samples_on_the_gpu(tmp_path):

    model, chat, rows = cuda_policy(tmp_path)
    flash = play_with_prefill(model, chat, rows, "varlen", temperature=0.0)
    masked = play_with_prefill(model, chat, rows, "sdpa", temperature=0.0)
    assert_same_until_they_part(flash, masked, tol=5e-2)
