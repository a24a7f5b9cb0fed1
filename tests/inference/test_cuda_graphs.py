"""Decode steps over fixed shapes (``clew.inference.cuda_graphs``): the padded rows and the
rounded-up widths sample what the plain steps sample; on CUDA, from captured graphs."""

from __future__ import annotations

import re

import pytest
import torch
from support.engine_cases import assert_same_until_they_part, cuda_policy
from support.rollout_cases import assert_same_samples, ending_at_different_turns

from clew.data.rows import generate_rows
from clew.errors import ConfigError
from clew.inference import cache_batch as batch_module
from clew.inference import cuda_graphs
from clew.inference.cuda_graphs import DecodeGraphs, rows_bucket, width_bucket
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat
from clew.rollout.loop import RolloutSettings, play


def test_rows_round_up_to_powers_of_two_then_multiples_of_sixteen_within_the_slots():
    assert [rows_bucket(n, 256) for n in (1, 2, 3, 5, 8, 9, 16, 17, 191)] == [
        1, 2, 4, 8, 8, 16, 16, 32, 192
    ]  # fmt: skip
    assert rows_bucket(9, 12) == 12


def test_widths_round_up_to_the_step_within_the_capacity():
    step = cuda_graphs.WIDTH_STEP
    assert width_bucket(1, 4 * step) == step
    assert width_bucket(step + 1, 4 * step) == 2 * step
    assert width_bucket(step + 1, step + 10) == step + 10


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl")
    build_model("tiny", path, arch="qwen3_vl", image_size=224, overwrite=True)
    model, processor = load_policy(path)
    model.eval()
    rows = generate_rows(
        "maze_2d/small", 3, env_options={"cell_px": 32, "action_format": "keyword"}
    )
    return model, ChatFormat(processor), rows


def _play(model, chat, rows, temperature, graphs: bool, device_kw=None, keep_last_k_images=None):
    settings = RolloutSettings(
        n_samples_per_prompt=3,  # 9 rows: 7 after the first turn, run padded to 8
        max_turns=4,
        max_input_length=4096,
        sampling=SamplingParams(temperature=temperature, max_tokens=6),
        keep_last_k_images=keep_last_k_images,
        env_workers=1,  # ending_at_different_turns counts episodes in the order they start
    )
    # Under a budget the slots are sized for the whole episode at once and never shrink,
    # so rows that leave leave free slots for padding. The decode paths are compared over
    # one prefill, the masked one (tests/kernels/test_prefill_attention.py compares the two), and
    # without the fused element-wise kernels (tests/kernels/test_fused_pointwise.py compares those).
    kw = {"prefill_attention": "sdpa", "fused_pointwise": False, **(device_kw or {})}
    engine = InferenceEngine(model, chat, cuda_graphs=graphs, max_cache_bytes=2**30, **kw)
    return play(engine, rows, settings, seed=3, env_factory=ending_at_different_turns())


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_padded_fixed_shape_steps_sample_what_the_plain_steps_sample(
    policy, temperature, monkeypatch
):
    model, chat, rows = policy
    # A narrow width step, so the widths are rounded up past the longest row.
    monkeypatch.setattr(cuda_graphs, "WIDTH_STEP", 64)
    shapes: list[tuple[int, int, int]] = []
    step = DecodeGraphs.step

    def recording(graphs, ids, pos, active, active_host, forward):
        logits = step(graphs, ids, pos, active, active_host, forward)
        r, w = graphs.last_shape
        shapes.append((ids.shape[0], r, w - graphs.cache.width))
        return logits

    monkeypatch.setattr(DecodeGraphs, "step", recording)
    sdpa = {"decode_attention": "sdpa"}  # the masked steps over rounded-up widths
    fixed = _play(model, chat, rows, temperature, graphs=True, device_kw=sdpa)
    plain = _play(model, chat, rows, temperature, graphs=False)
    assert sorted({t.turns for t in fixed}) == [1, 2, 3, 4]
    # Rows left, so some steps ran padding rows, and most read masked extra columns.
    assert any(r > b for b, r, _ in shapes)
    assert any(extra > 0 for _, _, extra in shapes)
    assert_same_samples(fixed, plain, tol=1e-5)


@pytest.mark.parametrize("attention", ["varlen", "triton"])
@pytest.mark.parametrize("keep_last", [None, 1], ids=["all-images", "last-image"])
def test_steps_by_length_read_each_row_s_length_and_sample_what_the_plain_steps_sample(
    policy, keep_last, attention, monkeypatch
):
    model, chat, rows = policy
    modes: list[str] = []
    step = DecodeGraphs.step

    def recording(graphs, ids, pos, active, active_host, forward):
        logits = step(graphs, ids, pos, active, active_host, forward)
        s = graphs._steps[(*graphs.last_shape, graphs.last_mode)]
        modes.append(graphs.last_mode)
        b = ids.shape[0]
        if graphs.last_mode == attention:  # each row reads its own columns, padding rows one
            assert s.lengths[:b].tolist() == graphs.cache.fill[:b]
            assert set(s.lengths[b:].tolist()) <= {1}
            assert graphs.last_shape[1] == graphs.cache.capacity
            assert s.kernel == (attention if attention != "varlen" else "efficient")
        return logits

    monkeypatch.setattr(DecodeGraphs, "step", recording)
    kw = {"keep_last_k_images": keep_last}
    varlen = _play(
        model, chat, rows, 1.0, graphs=True, device_kw={"decode_attention": attention}, **kw
    )
    plain = _play(model, chat, rows, 1.0, graphs=False, **kw)
    assert attention in modes
    # With hidden images a row's visible columns are not its first `length`: masked steps.
    assert ("sdpa" in modes) == (keep_last is not None)
    assert_same_samples(varlen, plain, tol=1e-5)


def test_an_unknown_decode_attention_is_refused_with_the_choices(policy):
    model, chat, _ = policy
    with pytest.raises(ConfigError, match="decode_attention='paged'.*auto, sdpa, varlen, triton"):
        InferenceEngine(model, chat, decode_attention="paged")


@pytest.mark.parametrize("stop", [(), ("zz",)], ids=["stop-tokens", "stop-strings"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graph-steps", "eager-steps"])
def test_the_next_step_is_launched_before_the_host_records_the_replies(
    policy, graphs, stop, monkeypatch
):
    model, chat, _ = policy
    # Half the vocabulary stops a reply: rows stop at different steps, some at the first.
    stops = tuple(range(0, len(chat.tokenizer), 2))
    events: list[str] = []
    launch, record = batch_module.CacheBatch._step, batch_module.CacheBatch._record

    def launching(batch, *args):
        events.append("launch")
        return launch(batch, *args)

    def recording(batch, *args):
        events.append("record")
        return record(batch, *args)

    prompts = [chat.user_turn(w, [], first=True) for w in ("left up", "down", "right stop")]
    params = SamplingParams(temperature=1.0, max_tokens=8, stop=stop)
    out = []
    for patched in (True, False):
        if patched:
            monkeypatch.setattr(batch_module.CacheBatch, "_step", launching)
            monkeypatch.setattr(batch_module.CacheBatch, "_record", recording)
        else:
            monkeypatch.undo()
        engine = InferenceEngine(model, chat, cuda_graphs=graphs, stop_token_ids=stops)
        batch = engine.open_batch(6, seed=4)
        gens = batch.extend_and_generate({i: prompts[i % 3] for i in range(6)}, params)
        later = batch.extend_and_generate({i: prompts[(i + 1) % 3] for i in range(6)}, params)
        assert batch.kv.fill == batch.kv.fill_dev.tolist()
        out.append([(g.token_ids, g.finish_reason) for g in (*gens.values(), *later.values())])
    assert out[0] == out[1]
    assert len({len(tokens) for tokens, _ in out[0]}) > 1  # rows stopped at different steps
    # Each turn's steps: without stop strings a step is launched, then the previous step's
    # replies are recorded; with them, recorded first; the last step launches nothing.
    order = "".join("L" if e == "launch" else "R" for e in events)
    assert re.fullmatch(r"((RL)*R)+" if stop else r"((LR)*R)+", order), order
    assert "L" in order


def test_a_batch_takes_the_fixed_shape_steps_only_where_the_engine_asks_for_them(policy):
    model, chat, rows = policy
    assert InferenceEngine(model, chat, cuda_graphs=True).open_batch(2).graphs is not None
    assert InferenceEngine(model, chat).open_batch(2).graphs is None


def test_under_bf16_autocast_the_fixed_shape_steps_run_and_sample_what_the_plain_steps_sample(
    policy,
):
    # Training's engine computes under autocast (float32 adapters over a bfloat16 base): its
    # decode steps take the fixed-shape (on CUDA, graphed) path too.
    model, chat, rows = policy
    assert InferenceEngine(model, chat, cuda_graphs=True, autocast=True).open_batch(2).graphs
    kw = {"decode_attention": "varlen", "autocast": True}
    fixed = _play(model, chat, rows, 0.0, graphs=True, device_kw=kw)
    plain = _play(model, chat, rows, 0.0, graphs=False, device_kw={"autocast": True})
    assert_same_until_they_part(fixed, plain, tol=5e-2)  # bf16: another summation order


@pytest.mark.gpu
def test_captured_graphs_sample_what_the_eager_steps_sample(tmp_path):
    model, chat, rows = cuda_policy()
    graphed, captures = _play_counting_captures(model, chat, rows, {"decode_attention": "sdpa"})
    eager = _play(model, chat, rows, 0.0, graphs=False)
    assert captures >= 2  # several buckets were captured and replayed
    assert_same_samples(graphed, eager, tol=2e-2)  # bf16: summation order differs with the width
    # The variable-length kernel, with and without hidden images.
    for keep in (None, 1):
        varlen = _play(
            model, chat, rows, 0.0, graphs=True, device_kw={"decode_attention": "varlen"},
            keep_last_k_images=keep,
        )  # fmt: skip
        reference = eager if keep is None else _play(model, chat, rows, 0.0, False, None, keep)
        assert_same_samples(varlen, reference, tol=2e-2)
    # clew's split-KV kernel: float32 softmax over bf16 products, another summation order:
    # greedy replies may part from the eager ones at a near tie, but not before, and not at
    # the first token.
    triton = _play(model, chat, rows, 0.0, graphs=True, device_kw={"decode_attention": "triton"})
    assert_same_until_they_part(triton, eager, tol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_graphs_captured_under_autocast_over_a_float32_adapter_sample_what_eager_steps_sample(
    tmp_path, fused
):
    from clew.train.lora import apply_lora

    model, chat, rows = cuda_policy()
    model = apply_lora(model, rank=8)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # a non-zero update, so the adapters count
            torch.nn.init.normal_(p, std=0.02)
    assert next(p for n, p in model.named_parameters() if "lora_A" in n).dtype == torch.float32
    kw = {"decode_attention": "triton", "autocast": True, "fused_pointwise": fused}
    graphed, captures = _play_counting_captures(model, chat, rows, kw)
    eager = _play(model, chat, rows, 0.0, graphs=False, device_kw={"autocast": True})
    assert captures >= 2
    assert_same_until_they_part(graphed, eager, tol=5e-2)


def _play_counting_captures(model, chat, rows, device_kw):
    """Greedy ``_play`` with graphs; its trajectories and the most graphs a batch captured."""
    captured = [0]
    step = DecodeGraphs.step

    def counting(graphs, *args):
        logits = step(graphs, *args)
        captured.append(graphs.captures)
        return logits

    DecodeGraphs.step = counting
    try:
        return _play(model, chat, rows, 0.0, graphs=True, device_kw=device_kw), max(captured)
    finally:
        DecodeGraphs.step = step


def test_an_opened_policy_replays_graphs_only_on_cuda(tmp_path):
    from clew.inference.runtime import open_policy

    build_model("tiny", tmp_path, arch="qwen3_vl", image_size=224, overwrite=True)
    assert open_policy(tmp_path, device="cpu", cuda_graphs=True).engine.cuda_graphs is False


def test_a_varlen_step_builds_its_kernel_index_once_for_every_layer():
    from clew.kernels.slot_views import row_lengths, varlen_index

    lengths = torch.tensor([3, 5])
    seqlens, cu_q, cu_k = varlen_index(lengths, kv_heads=2, cap=8, group=4)
    assert seqlens.tolist() == [3, 3, 5, 5]  # every (row, KV head) a sequence
    assert cu_q.tolist() == [0, 4, 8, 12, 16] and cu_k.tolist() == [0, 8, 16, 24, 32]
    with row_lengths(lengths):
        first = varlen_index(lengths, 2, 8, 4)
        assert all(a is b for a, b in zip(first, varlen_index(lengths, 2, 8, 4), strict=True))
    assert varlen_index(lengths, 2, 8, 4)[0] is not first[0]  # outside a step: built anew
