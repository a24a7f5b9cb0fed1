"""The engine's in-place KV cache (``SlotCache``) on tiny Qwen2-VL and Qwen3-VL policies: the
logprobs of the trainer's whole-sequence forward, buffers written in place, and a budget
counted by real lengths."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.rollout_cases import assert_same_samples, ending_at_different_turns
from transformers.integrations.sdpa_attention import repeat_kv

from clew.data.rows import generate_rows
from clew.envs import make
from clew.errors import ConfigError
from clew.inference import cache_batch as batch_module
from clew.inference import engine as engine_module
from clew.inference.attention import gqa_sdpa_attention, text_config
from clew.inference.engine import InferenceEngine
from clew.inference.kv_cache import SlotCache, cache_budget_bytes
from clew.inference.sampling import SamplingParams
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat
from clew.rollout.episode_stats import rollout_metrics
from clew.rollout.loop import RolloutSettings, play
from clew.train import PolicyWorker
from clew.train.lora import apply_lora, merged_for_rollouts

IMAGE_SIZE = {"qwen2_vl": 196, "qwen3_vl": 224}  # 7 x 7 cells, one token each
OPTIONS = {"qwen2_vl": {"cell_px": 28}, "qwen3_vl": {"cell_px": 32}}


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def policy(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    build_model("tiny", path, arch=arch, image_size=IMAGE_SIZE[arch], overwrite=True)
    model, processor = load_policy(path)
    model.eval()
    rows = generate_rows(
        "maze_2d/small", 3, env_options={**OPTIONS[arch], "action_format": "keyword"}
    )
    return model, ChatFormat(processor), rows


def _settings(temperature: float = 1.0, **kw) -> RolloutSettings:
    sampling = SamplingParams(
        temperature=temperature, max_tokens=kw.pop("max_tokens", 6), top_p=kw.pop("top_p", 1.0)
    )
    return RolloutSettings(
        **{
            "n_samples_per_prompt": 2,
            "max_turns": 4,
            "max_input_length": 4096,
            "env_workers": 1,
            **kw,
        },
        sampling=sampling,
    )


def _play(model, chat, rows, settings, seed=3, **engine_kw):
    engine = InferenceEngine(model, chat, **engine_kw)
    return play(engine, rows, settings, seed=seed, env_factory=ending_at_different_turns())


def assert_trainer_logprobs(model, chat, trajs, tol: float = 1e-4) -> None:
    """The sampled tokens' logprobs are those the trainer computes over each whole sequence
    (transformers' own forward, no KV cache; hidden images as ``image_window`` says), at
    temperature 1 as the engine logs greedy and top-p draws."""
    recomputed = PolicyWorker(model, chat).compute_logprobs(trajs, 1.0, 4)
    model.eval()
    worst = 0.0
    for t, lp in zip(trajs, recomputed, strict=True):
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        worst = max(worst, float((lp[mask] - torch.tensor(t.logprobs[1:])[mask]).abs().max()))
    assert worst < tol, f"largest logprob difference {worst:.2e}"


@pytest.mark.parametrize(
    "temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (1.0, 0.9)], ids=["greedy", "seeded", "top_p"]
)
def test_the_cache_gives_the_logprobs_of_a_whole_sequence_forward(policy, temperature, top_p):
    model, chat, rows = policy
    settings = _settings(temperature, top_p=top_p)
    trajs = _play(model, chat, rows, settings)
    # Rows left the batch at every turn, so later rows moved into the freed slots.
    assert sorted({t.turns for t in trajs}) == [1, 2, 3, 4]
    assert_trainer_logprobs(model, chat, trajs)
    # The same seed draws the same episodes again.
    assert_same_samples(_play(model, chat, rows, settings), trajs)
    # The trainer's forwards keep their own attention.
    assert text_config(model)._attn_implementation == "sdpa"


def test_hidden_images_are_masked_and_compacted_in_place_with_the_same_samples(policy, monkeypatch):
    model, chat, rows = policy
    settings = _settings(max_turns=6, keep_last_k_images=1)
    widths: list[tuple[int, int]] = []
    compact = SlotCache.compact

    def recording(cache, threshold):
        before = cache.width
        compact(cache, threshold)
        widths.append((before, cache.width))

    monkeypatch.setattr(SlotCache, "compact", recording)
    engine = InferenceEngine(model, chat)
    compacted = play(engine, rows, settings, seed=5)
    assert any(after < before for before, after in widths)
    assert_trainer_logprobs(model, chat, compacted)
    # Never compacting gives the same samples too: hidden columns were masked all along.
    monkeypatch.setattr(batch_module, "_COMPACT_WHEN_VISIBLE_BELOW", 0.0)
    assert_same_samples(play(engine, rows, settings, seed=5), compacted)


def test_a_merged_lora_policy_gives_the_logprobs_of_the_unmerged_one(policy):
    model, chat, rows = policy
    import copy

    lora = apply_lora(copy.deepcopy(model), rank=4, alpha=8)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    lora.eval()
    with merged_for_rollouts(lora):
        merged = _play(lora, chat, rows, _settings())
        plain = play(InferenceEngine(model, chat), rows, _settings(), seed=3)
    assert_trainer_logprobs(lora, chat, merged)  # the adapter unmerged again
    assert [t.token_ids for t in merged] != [t.token_ids for t in plain]  # the adapter counts


def test_no_forward_moves_the_cache_buffers(policy, monkeypatch):
    model, chat, rows = policy
    seen: list[tuple[int, ...]] = []
    forward = engine_module.CacheBatch._forward

    def recording(cached, *args, **kwargs):
        logits = forward(cached, *args, **kwargs)
        seen.append(tuple(t.data_ptr() for t in cached.kv.buffers()))
        return logits

    monkeypatch.setattr(engine_module.CacheBatch, "_forward", recording)
    settings = _settings(keep_last_k_images=1)
    # Under a budget the slots are sized for the episodes' expected length at once.
    budget = 64 * settings.max_input_length * InferenceEngine(model, chat).bytes_per_token
    _play(model, chat, rows, settings, max_cache_bytes=budget)
    assert len(seen) >= 4 * 2  # four turns of a prefill and decode steps
    assert len(set(seen)) == 1


def test_the_budget_counts_rows_by_their_real_lengths(policy, monkeypatch):
    model, chat, rows = policy
    settings = _settings(max_input_length=4096, max_turns=3)
    waves: list[int] = []
    opened = InferenceEngine.open_batch

    def recording(engine, size, *args, **kwargs):
        waves.append(size)
        return opened(engine, size, *args, **kwargs)

    monkeypatch.setattr(InferenceEngine, "open_batch", recording)
    bytes_per_token = InferenceEngine(model, chat).bytes_per_token
    budget = 2 * settings.max_input_length * bytes_per_token  # two rows as long as allowed
    trajs = _play(model, chat, rows, settings, max_cache_bytes=budget)
    assert waves == [6]  # every episode is a few hundred tokens long
    assert rollout_metrics(trajs, "train")["train/waves"] == 1
    # A budget of two such episodes runs several waves; each episode knows its wave, and
    # the step's metrics count them.
    obs = make(rows[0].env_id, **rows[0].options()).reset(rows[0].seed)
    first = chat.user_turn(obs.text, obs.images, first=True)
    expected = 3 * (len(first.token_ids) + settings.sampling.max_tokens + 1)
    waves.clear()
    settings = replace(settings, max_input_length=expected)  # a budget holds one at least
    small = _play(model, chat, rows, settings, max_cache_bytes=2 * expected * bytes_per_token)
    assert len(waves) > 1 and sum(waves) == 6
    assert sorted(t.wave for t in small) == [w for w, n in enumerate(waves) for _ in range(n)]
    assert rollout_metrics(small, "train")["train/waves"] == len(waves)
    assert all(t.end_reason != "cache_budget" for t in trajs + small)
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        play(InferenceEngine(model, chat, max_cache_bytes=expected), rows, settings, seed=0)


def test_a_turn_that_outgrows_the_budget_ends_only_the_episodes_it_must(policy):
    model, chat, rows = policy
    engine = InferenceEngine(model, chat)

    def growing(env_id, **options):
        # Each observation is longer than the last, past what the wave was packed for.
        env = make(env_id, **options)
        step = env.step

        def stepping(text):
            obs, reward, done, info = step(text)
            return replace(obs, text=obs.text + " left" * 150 * env.turn), reward, done, info

        env.step = stepping
        return env

    settings = _settings(max_turns=3, max_input_length=1024, n_samples_per_prompt=3)
    obs = make(rows[0].env_id, **rows[0].options()).reset(rows[0].seed)
    first = chat.user_turn(obs.text, obs.images, first=True)
    expected = 3 * (len(first.token_ids) + settings.sampling.max_tokens + 1)
    engine.max_cache_bytes = 3 * expected * engine.bytes_per_token  # one wave of three
    trajs = play(engine, rows[:1], settings, seed=0, env_factory=growing)
    reasons = [t.end_reason for t in trajs]
    assert "cache_budget" in reasons and reasons.count("cache_budget") < 3


def test_a_second_rollout_packs_its_waves_by_the_later_turns_it_has_seen(policy, monkeypatch):
    model, chat, rows = policy
    turns = 6
    settings = _settings(max_turns=turns, n_samples_per_prompt=2)  # 6 episodes
    sizes: list[int] = []
    opened = InferenceEngine.open_batch

    def recording(engine, size, *args, **kwargs):
        sizes.append(size)
        return opened(engine, size, *args, **kwargs)

    monkeypatch.setattr(InferenceEngine, "open_batch", recording)
    engine = InferenceEngine(model, chat)
    obs = make(rows[0].env_id, **rows[0].options()).reset(rows[0].seed)
    first = len(chat.user_turn(obs.text, obs.images, first=True).token_ids)
    # With nothing seen yet an episode is counted as `turns` turns as long as its first (the
    # instructions make the first observation two to three times a later one's length).
    counted = turns * (first + settings.sampling.max_tokens + 1)
    settings = replace(settings, max_input_length=counted)
    engine.max_cache_bytes = 4 * counted * engine.bytes_per_token  # four such episodes
    before = play(engine, rows, settings, seed=0)
    first_sizes, sizes[:] = list(sizes), []
    after = play(engine, rows, settings, seed=0)
    assert first_sizes[0] == 4
    assert max(sizes) > 4  # later turns seen: more episodes share a wave
    # Packed tighter, and still no turn outgrew the budget.
    assert all(t.end_reason != "cache_budget" for t in before + after)


def test_gqa_attention_equals_attention_over_repeated_kv_heads():
    torch.manual_seed(0)
    b, heads, kv_heads, width, d = 3, 8, 2, 11, 16

    class Module(torch.nn.Module):
        num_key_value_groups = heads // kv_heads

    key = torch.randn(b, kv_heads, width, d)
    value = torch.randn(b, kv_heads, width, d)
    for t in (1, 4):
        query = torch.randn(b, heads, t, d)
        mask = torch.rand(b, 1, t, width) < 0.7
        mask[..., 0] = True  # every query sees something
        ours, _ = gqa_sdpa_attention(Module(), query, key, value, mask, scaling=d**-0.5)
        reference = torch.nn.functional.scaled_dot_product_attention(
            query, repeat_kv(key, 4), repeat_kv(value, 4), attn_mask=mask, scale=d**-0.5
        ).transpose(1, 2)
        assert ours.shape == (b, t, heads, d)
        assert torch.allclose(ours, reference, atol=1e-6)


def test_the_gpu_budget_counts_live_tensors_not_the_blocks_the_allocator_keeps(monkeypatch):
    # 80 GiB card, 0.45 of it for the process: 16 GiB of live weights, and 30 GiB more that
    # an earlier run left cached in torch's allocator (the device sees it as used).
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (34 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 16 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 46 * gib)
    cuda = torch.device("cuda", 0)
    assert cache_budget_bytes(cuda, 0.45, 4096) == int(80 * gib * 0.45) - 16 * gib
    # Another process holding most of the card: what is free, and cached, bounds the budget.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 20 * gib)
    assert cache_budget_bytes(cuda, 0.45, 4096) == 5 * gib
    assert cache_budget_bytes(torch.device("cpu"), 0.45, 4096) == 4096 * 2**20
