"""The static KV cache against the dynamic one on tiny Qwen2-VL and Qwen3-VL policies: the
same tokens and logprobs, buffers written in place, and a budget counted by real lengths."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rollout_support import assert_same_samples, ending_at_different_turns
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


def _both(model, chat, rows, settings, seed=3, **engine_kw):
    out = []
    for kv_cache in ("static", "dynamic"):
        engine = InferenceEngine(model, chat, kv_cache=kv_cache, **engine_kw)
        out.append(play(engine, rows, settings, seed=seed, env_factory=ending_at_different_turns()))
    return out


@pytest.mark.parametrize(
    "temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (1.0, 0.9)], ids=["greedy", "seeded", "top_p"]
)
def test_static_cache_samples_what_the_dynamic_cache_samples(policy, temperature, top_p):
    model, chat, rows = policy
    settings = _settings(temperature, top_p=top_p)
    static, dynamic = _both(model, chat, rows, settings)
    # Rows left the batch at every turn, so later rows moved into the freed slots.
    assert sorted({t.turns for t in static}) == [1, 2, 3, 4]
    assert_same_samples(static, dynamic)
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
    engine = InferenceEngine(model, chat, kv_cache="static")
    static = play(engine, rows, settings, seed=5)
    dynamic = play(InferenceEngine(model, chat, kv_cache="dynamic"), rows, settings, seed=5)
    assert any(after < before for before, after in widths)
    assert_same_samples(static, dynamic)
    # Never compacting gives the same samples too: hidden columns were masked all along.
    monkeypatch.setattr(batch_module, "_COMPACT_WHEN_VISIBLE_BELOW", 0.0)
    assert_same_samples(play(engine, rows, settings, seed=5), dynamic)


def test_a_merged_lora_policy_samples_the_same_with_either_cache(policy):
    model, chat, rows = policy
    import copy

    lora = apply_lora(copy.deepcopy(model), rank=4, alpha=8)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    lora.eval()
    with merged_for_rollouts(lora):
        static, dynamic = _both(lora, chat, rows, _settings())
        plain = play(InferenceEngine(model, chat), rows, _settings(), seed=3)
    assert_same_samples(static, dynamic)
    assert [t.token_ids for t in static] != [t.token_ids for t in plain]  # the adapter counts


def test_no_forward_moves_the_cache_buffers(policy, monkeypatch):
    model, chat, rows = policy
    seen: dict[str, list[tuple[int, ...]]] = {"static": [], "dynamic": []}
    forward = engine_module.CacheBatch._forward

    def recording(cached, *args, **kwargs):
        logits = forward(cached, *args, **kwargs)
        if isinstance(cached.kv, SlotCache):
            seen["static"].append(tuple(t.data_ptr() for t in cached.kv.buffers()))
        else:
            seen["dynamic"].append(tuple(layer.keys.data_ptr() for layer in cached.cache.layers))
        return logits

    monkeypatch.setattr(engine_module.CacheBatch, "_forward", recording)
    settings = _settings(keep_last_k_images=1)
    # Under a budget the slots are sized for the episodes' expected length at once.
    budget = 64 * settings.max_input_length * InferenceEngine(model, chat).bytes_per_token
    _both(model, chat, rows, settings, max_cache_bytes=budget)
    assert len(seen["static"]) >= 4 * 2  # four turns of a prefill and decode steps
    assert len(set(seen["static"])) == 1
    # The reference concatenates a new tensor every forward (the allocator may hand an old
    # address back, so only most of them are new).
    assert len(set(seen["dynamic"])) > len(seen["dynamic"]) // 2


def test_the_budget_admits_more_rows_when_they_are_short(policy, monkeypatch):
    model, chat, rows = policy
    settings = _settings(max_input_length=4096, max_turns=3)
    waves: dict[str, list[int]] = {"static": [], "dynamic": []}
    opened = InferenceEngine.open_batch

    def recording(engine, size, *args, **kwargs):
        waves[engine.kv_cache].append(size)
        return opened(engine, size, *args, **kwargs)

    monkeypatch.setattr(InferenceEngine, "open_batch", recording)
    bytes_per_token = InferenceEngine(model, chat).bytes_per_token
    budget = 2 * settings.max_input_length * bytes_per_token  # two rows as long as allowed
    static, dynamic = _both(model, chat, rows, settings, max_cache_bytes=budget)
    assert waves["dynamic"] == [2, 2, 2]
    assert waves["static"] == [6]  # every episode is a few hundred tokens long
    # Each episode knows its wave, and the step's metrics count them.
    assert sorted(t.wave for t in dynamic) == [0, 0, 1, 1, 2, 2]
    assert rollout_metrics(dynamic, "train")["train/waves"] == 3
    assert rollout_metrics(static, "train")["train/waves"] == 1
    assert all(t.end_reason != "cache_budget" for t in static + dynamic)
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        play(InferenceEngine(model, chat, max_cache_bytes=budget // 4), rows, settings, seed=0)


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


def test_an_unknown_kv_cache_is_refused(policy):
    model, chat, _ = policy
    with pytest.raises(ConfigError, match="kv_cache='paged'.*static, dynamic"):
        InferenceEngine(model, chat, kv_cache="paged")


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
