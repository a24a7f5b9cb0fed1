"""A turn's prefill through fixed-shape buckets (``clew.inference.prefill_graphs``) over KV
buffers kept between batches (``clew.inference.kv_store``): the bucketed layers sample what
the model's own forward samples; on CUDA, from captured graphs replayed by later batches."""

from __future__ import annotations

import gc

import pytest
import torch
from support.engine_cases import assert_same_until_they_part, cuda_policy, maze_policy  # noqa: F401 (fixture)
from support.rollout_cases import assert_same_samples, ending_at_different_turns

from clew.config import load_config
from clew.config.settings import engine_options
from clew.inference.engine import InferenceEngine
from clew.inference.kv_store import KVStore
from clew.inference.prefill_graphs import CHUNK_WIDTH_STEP
from clew.inference.sampling import SamplingParams
from clew.rollout.loop import RolloutSettings, play


def _play(engine, rows, temperature=1.0, max_tokens=6):
    settings = RolloutSettings(
        n_samples_per_prompt=3,  # 9 rows, fewer as episodes end: padded rows in the buckets
        max_turns=4,
        max_input_length=4096,
        sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens),
        keep_last_k_images=1,  # images hidden from the second turn: the padded prefill
        env_workers=1,  # ending_at_different_turns counts episodes in the order they start
    )
    return play(engine, rows, settings, seed=3, env_factory=ending_at_different_turns())


def _engine(model, chat, graphs: bool, **kw):
    kw = {"prefill_attention": "sdpa", "fused_pointwise": False, "max_cache_bytes": 2**30, **kw}
    return InferenceEngine(model, chat, prefill_graphs=graphs, **kw)


def test_bucketed_prefill_layers_sample_what_the_model_s_own_forward_samples(maze_policy):  # noqa: F811
    model, chat, rows = maze_policy
    engine = _engine(model, chat, graphs=True)
    bucketed = _play(engine, rows)
    plain = _play(_engine(model, chat, graphs=False), rows)
    assert engine.prefill_graphs.replays >= 3  # turns 2 to 4 went through the buckets
    shapes = engine.prefill_graphs.shapes
    assert shapes and all(rows >= 1 for rows, _, _ in shapes)
    # Chunks padded to a multiple of the step, so a few widths make a run's captures.
    assert all(chunk % CHUNK_WIDTH_STEP == 0 for _, chunk, _ in shapes)
    assert_same_samples(bucketed, plain, tol=1e-5)


def test_a_later_batch_writes_into_the_kept_buffers_and_samples_what_a_fresh_cache_samples(
    maze_policy,  # noqa: F811
):
    model, chat, rows = maze_policy
    engine = _engine(model, chat, graphs=True)
    _play(engine, rows)  # sizes the cache by the first chunks; later batches by later ones
    second = _play(engine, rows)
    third = _play(engine, rows)  # a finished batch's cache is freed when it goes: no gc run
    assert engine.kv_store.reused >= 1  # the third batch took the second one's buffers
    assert_same_samples(third, second, tol=1e-6)


def test_padding_rows_of_a_bucket_leave_the_live_rows_unchanged(maze_policy):  # noqa: F811
    model, chat, rows = maze_policy
    engine = _engine(model, chat, graphs=True)
    seen: list[tuple[int, int]] = []
    run = engine.prefill_graphs.run

    def recording(text_model, kwargs, kv, cache_kw):
        out = run(text_model, kwargs, kv, cache_kw)
        if out is not None:  # a bucket took it
            seen.append((kwargs["inputs_embeds"].shape[0], engine.prefill_graphs.last_shape[0]))
        return out

    engine.prefill_graphs.run = recording
    bucketed = _play(engine, rows, temperature=0.0)
    assert any(rows_in < bucket for rows_in, bucket in seen)  # some bucket had padding rows
    assert_same_samples(bucketed, _play(_engine(model, chat, False), rows, 0.0), tol=1e-5)


def test_the_store_lends_a_set_to_one_live_cache_at_a_time_and_zeroes_it_for_the_next():
    store = KVStore(keep=1)
    shape = (2, 1, 4, 3)

    class Owner:
        pass

    a, b = Owner(), Owner()
    lent = store.buffers(a, 2, shape, shape, torch.float32, torch.device("cpu"))
    lent[0][0].fill_(7.0)
    other = store.buffers(b, 2, shape, shape, torch.float32, torch.device("cpu"))
    assert other[0][0].data_ptr() != lent[0][0].data_ptr()  # a is alive: b gets its own
    del a, b
    gc.collect()
    again = store.buffers(Owner(), 2, shape, shape, torch.float32, torch.device("cpu"))
    assert again[0][0].data_ptr() == lent[0][0].data_ptr() and store.reused == 1
    assert float(again[0][0].abs().sum()) == 0.0
    keeper = Owner()
    store.buffers(keeper, 2, (1, 1, 2, 3), (1, 1, 2, 3), torch.float32, torch.device("cpu"))
    assert len(store._sets) == 1  # keep=1: the free set of the other shape went


def test_prefill_graphs_come_from_the_config_and_enforce_eager_turns_them_off():
    on = load_config(None, ["generator.inference_engine.prefill_cuda_graphs=true"])
    assert engine_options(on).prefill_cuda_graphs is True
    eager = load_config(
        None,
        [
            "generator.inference_engine.prefill_cuda_graphs=true",
            "generator.inference_engine.enforce_eager=true",
        ],
    )
    assert engine_options(eager).prefill_cuda_graphs is False


@pytest.mark.gpu
def test_captured_prefill_graphs_sample_what_eager_prefills_sample_and_later_batches_replay():
    model, chat, rows = cuda_policy()
    engine = _engine(model, chat, graphs=True)
    graphed = _play(engine, rows, temperature=0.0)
    captured = engine.prefill_graphs.captures
    assert captured >= 2
    eager = _play(_engine(model, chat, graphs=False), rows, temperature=0.0)
    # bfloat16 over other shapes: the same replies until a near tie parts them.
    assert_same_until_they_part(graphed, eager, tol=2e-2)
    gc.collect()
    graphed = _play(engine, rows, temperature=0.0)  # the cache sized as later steps size it
    captured = engine.prefill_graphs.captures
    gc.collect()
    again = _play(engine, rows, temperature=0.0)
    assert engine.prefill_graphs.captures == captured  # the same shapes replayed, none new
    assert_same_samples(again, graphed, tol=1e-6)
