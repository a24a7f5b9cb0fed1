"""A packed prefill (the engine's on a GPU, with ``prefill_attention`` triton or varlen): the
rows' new tokens alone, row after row in one sequence, give the attention, the samples and
the logprobs of the left-padded prefill."""

from __future__ import annotations

import pytest
import torch
from support.engine_cases import chunk_case, eight_b_case
from support.rollout_cases import assert_same_samples, ending_at_different_turns

from clew.inference import cache_batch as batch_module
from clew.inference.attention import gqa_sdpa_attention
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.kernels.prefill_triton import prefill_triton
from clew.kernels.prefill_varlen import varlen_prefill
from clew.kernels.slot_views import prefill_lengths
from clew.models.chat import Chunk
from clew.rollout.loop import RolloutSettings, play


def _packed(query: torch.Tensor, new: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded queries [B, H, T, D] as packed ones [1, H, N, D] and their starts."""
    t = query.shape[2]
    rows = [query[r, :, t - n :] for r, n in enumerate(new)]
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    return torch.cat(rows, 1)[None], starts


@pytest.mark.parametrize("kernel", ["varlen", "triton"])
def test_packed_chunks_get_the_attention_of_the_padded_ones(kernel):
    query, key, value, lengths, mask, real = chunk_case()
    expected, _ = gqa_sdpa_attention(None, query, key, value, mask)  # [rows, T, H, D]
    new = real.sum(1).tolist()  # 5, 2 and 3 real tokens
    packed, starts = _packed(query, new)
    if kernel == "varlen":
        got = varlen_prefill(packed, key, value, lengths, starts=starts, max_new=max(new))
    else:
        got = prefill_triton(
            packed, key, value, lengths, starts=starts, max_new=max(new), interpret=True
        )
    assert got.shape == (1, sum(new), *expected.shape[2:])
    torch.testing.assert_close(got[0], expected[real], atol=1e-5, rtol=1e-5)
    with prefill_lengths(lengths, kernel, starts, max(new)):
        inside, _ = gqa_sdpa_attention(None, packed, key, value, None)
    torch.testing.assert_close(inside, got)


def test_a_row_with_no_new_token_takes_no_query():
    query, key, value, lengths, mask, real = chunk_case()
    new = [5, 0, 3]
    packed, starts = _packed(query, new)
    lengths = lengths.clone()
    lengths[1] = 6  # the middle row's cache as it was
    for got in (
        varlen_prefill(packed, key, value, lengths, starts=starts, max_new=5),
        prefill_triton(packed, key, value, lengths, starts=starts, max_new=5, interpret=True),
    ):
        assert got.shape[1] == 8 and torch.isfinite(got).all()


def _engine(model, chat, packed: bool, **kw) -> InferenceEngine:
    """An engine that packs its prefills or pads them: the engine packs on a GPU only, so
    the CPU tests turn packing on (and off) themselves."""
    engine = InferenceEngine(model, chat, **kw)
    engine.pack_prefill = packed
    return engine


def _play(model, chat, rows, prefill: str, packed: bool, keep_last_k_images=None):
    settings = RolloutSettings(
        n_samples_per_prompt=3,
        max_turns=4,
        max_input_length=4096,
        sampling=SamplingParams(temperature=1.0, max_tokens=6),
        keep_last_k_images=keep_last_k_images,
        env_workers=1,
    )
    engine = _engine(model, chat, packed, prefill_attention=prefill)
    return play(engine, rows, settings, seed=3, env_factory=ending_at_different_turns())


@pytest.mark.parametrize("prefill", ["varlen", "triton"])
def test_a_rollout_with_packed_prefills_samples_what_padded_prefills_sample(
    maze_policy,
    prefill,
    monkeypatch,
):
    model, chat, rows = maze_policy
    forwards: list[int] = []
    inner = batch_module.CacheBatch._packed_forward

    def counted(self, part, lengths, extra):
        forwards.append(part.hi - part.lo)
        return inner(self, part, lengths, extra)

    monkeypatch.setattr(batch_module.CacheBatch, "_packed_forward", counted)
    packed = _play(model, chat, rows, prefill, packed=True)
    assert forwards and forwards[0] == 9  # every prefill, from the first turn's 9 prompts on
    count = len(forwards)
    padded = _play(model, chat, rows, "sdpa", packed=False)
    assert len(forwards) == count  # the padded prefill never packs
    assert_same_samples(packed, padded, tol=1e-5)


def test_while_images_are_hidden_the_prefill_stays_padded(maze_policy, monkeypatch):
    model, chat, rows = maze_policy
    kinds: list[str] = []
    inner_packed = batch_module.CacheBatch._packed_forward
    inner = batch_module.CacheBatch._forward

    def packed_forward(self, part, lengths, extra):
        kinds.append("packed")
        return inner_packed(self, part, lengths, extra)

    def forward(self, input_ids, *args, **kwargs):
        if kwargs.get("keep") is None and input_ids.shape[1] > 1:
            kinds.append("padded")
        return inner(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(batch_module.CacheBatch, "_packed_forward", packed_forward)
    monkeypatch.setattr(batch_module.CacheBatch, "_forward", forward)
    packed = _play(model, chat, rows, "varlen", packed=True, keep_last_k_images=1)
    # Packed while no image is hidden; padded (the masked prefill) while one is, until the
    # hidden columns are compacted away.
    assert kinds[0] == "packed" and "padded" in kinds
    padded = _play(model, chat, rows, "sdpa", packed=False, keep_last_k_images=1)
    assert_same_samples(packed, padded, tol=1e-5)


def test_rows_joining_a_running_batch_are_packed_on_their_own_slots(maze_policy):
    model, chat, rows = maze_policy
    from clew.envs import make

    prompts = []
    for row in rows[:2]:
        obs = make(row.env_id, **row.options()).reset(seed=row.seed)
        prompts.append(chat.user_turn(obs.text, obs.images, first=True))
    params = SamplingParams(temperature=0.0, max_tokens=3)
    out = {}
    for packed in (False, True):
        engine = _engine(model, chat, packed, prefill_attention="varlen", stop_token_ids=(-1,))
        batch = engine.open_batch(2, seed=1, capacity_hint=512)
        short = chat.user_turn("left right up down", [], first=True)
        first = batch.extend_and_generate({0: prompts[0], 1: short}, params)
        (joined,) = batch.add_rows(1, tokens=512)
        later = batch.extend_and_generate({0: Chunk([]), 1: Chunk([]), joined: prompts[1]}, params)
        out[packed] = [(g.token_ids, g.logprobs) for g in (*first.values(), *later.values())]
    for (a_tokens, a_lp), (b_tokens, b_lp) in zip(out[True], out[False], strict=True):
        assert a_tokens == b_tokens
        assert max(abs(x - y) for x, y in zip(a_lp, b_lp, strict=True)) < 1e-5


def test_the_engine_packs_on_cuda_only_and_stays_padded_where_nothing_reads_lengths(
    maze_policy,
    monkeypatch,
):
    model, chat, rows = maze_policy
    # On a CPU the packed attention is the masked reference: the engine pads there.
    assert not InferenceEngine(model, chat, prefill_attention="varlen").pack_prefill
    # With an attention that does not read rows by their lengths the prefill stays padded.
    calls: list[int] = []
    inner = batch_module.CacheBatch._packed_forward

    def packed_forward(self, part, lengths, extra):
        calls.append(1)
        return inner(self, part, lengths, extra)

    monkeypatch.setattr(batch_module.CacheBatch, "_packed_forward", packed_forward)
    _play(model, chat, rows, "sdpa", packed=True)
    assert not calls


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["varlen", "triton"])
def test_on_the_gpu_packed_chunks_get_the_attention_of_the_padded_ones(kernel):
    # Qwen3-VL-8B's attention (32 query heads over 8 KV heads of 128), 48 rows of 15-turn
    # widths, chunks of 100-140 new tokens left-padded to 140.

    rows, t = 48, 140
    query, keys, values, lengths = eight_b_case(rows, t=t)
    new = torch.randint(100, t + 1, (rows,), generator=torch.Generator().manual_seed(0)).tolist()
    packed, starts = _packed(query, new)
    attend = varlen_prefill if kernel == "varlen" else prefill_triton
    padded = attend(query, keys, values, lengths)
    got = attend(packed, keys, values, lengths, starts=starts.cuda(), max_new=max(new))
    real = torch.arange(t)[None, :] >= (t - torch.tensor(new))[:, None]
    torch.testing.assert_close(got[0].float(), padded[real.cuda()].float(), atol=2e-2, rtol=2e-2)
