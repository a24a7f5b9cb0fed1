"""Tests for clew.kernels.fused_pointwise: the rotary embedding and the SwiGLU gate compiled.

On a CPU the kernels are compiled by Inductor's C++ backend when the tests add "cpu" to
``COMPILE_DEVICES``: the same compiled functions a GPU runs through Triton."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from support.rollout_cases import assert_same_samples
from transformers.models.qwen3_vl import modeling_qwen3_vl

from clew.data.rows import generate_rows
from clew.inference import cache_batch as batch_module
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.kernels import fused_pointwise
from clew.kernels.fused_pointwise import fuse_pointwise, pointwise_fused, rotary, silu_mul
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat
from clew.rollout.loop import RolloutSettings, play


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(fused_pointwise, "COMPILE_DEVICES", {"cuda", "cpu"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl")
    build_model("tiny", path, arch="qwen3_vl", image_size=84, patch_size=14, overwrite=True)
    model, processor = load_policy(path)
    return model.eval(), ChatFormat(processor)


def _counts() -> dict[str, int]:
    return dict(fused_pointwise.calls)


def test_the_compiled_kernels_compute_transformers_rotary_and_gate(on_cpu) -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 5, 32, generator=g), torch.randn(3, 2, 5, 32, generator=g)
    cos, sin = torch.randn(3, 5, 32, generator=g), torch.randn(3, 5, 32, generator=g)
    original = modeling_qwen3_vl.apply_rotary_pos_emb
    original = getattr(original, "_clew_original", original)
    before = _counts()
    with pointwise_fused():
        got = fused_pointwise._fused("rotary", rotary, q, k, cos, sin, 1)
        gate = fused_pointwise._fused("silu_mul", silu_mul, q, q.flip(0))
    for a, b in zip(got, original(q, k, cos, sin), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gate, torch.nn.functional.silu(q) * q.flip(0))
    after = _counts()
    assert after.get("rotary", 0) == before.get("rotary", 0) + 1
    assert after.get("silu_mul", 0) == before.get("silu_mul", 0) + 1


def test_another_row_count_does_not_compile_the_kernel_again(on_cpu) -> None:
    from torch._dynamo.utils import counters

    def probe(q, k, cos, sin):  # a code object of its own: its own compilations
        return rotary(q, k, cos, sin, 1)

    def call(rows: int, kv_heads: int, width: int) -> None:
        q = torch.randn(rows, 4, width, 16)
        k = torch.randn(rows, kv_heads, width, 16)
        cos = sin = torch.randn(rows, width, 16)
        with pointwise_fused():
            fused_pointwise._fused("probe_rows", probe, q, k, cos, sin)

    call(2, 2, 3)  # rows equal to KV heads: duck shapes would make them one size
    graphs = counters["stats"]["unique_graphs"]
    call(7, 2, 5)
    call(8, 8, 9)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_fused_policy_takes_the_kernels_only_inside_pointwise_fused(tiny, on_cpu) -> None:
    model, chat = tiny
    fused = copy.deepcopy(model)
    layers = fused.config.get_text_config().num_hidden_layers
    assert fuse_pointwise(fused) == layers
    assert fuse_pointwise(fused) == 0  # once
    ids = torch.tensor([chat.encode_text("go left then down") * 2])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        before = _counts()
        outside = fused(input_ids=ids).logits
        assert _counts() == before  # the trainer's forwards: transformers' own code
        torch.testing.assert_close(outside, want, rtol=0, atol=0)
        with pointwise_fused():
            inside = fused(input_ids=ids).logits
    after = _counts()
    assert after["rotary"] - before.get("rotary", 0) == layers
    assert after["silu_mul"] - before.get("silu_mul", 0) == layers
    torch.testing.assert_close(inside, want, rtol=1e-4, atol=1e-5)


def test_the_vision_tower_takes_the_fused_rotary_inside_pointwise_fused(tiny, on_cpu) -> None:
    model, chat = tiny
    fused = copy.deepcopy(model)
    fuse_pointwise(fused)
    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 256, (84, 84, 3), dtype=np.uint8)) for _ in "ab"]
    vision = chat.processor.image_processor(images=frames, return_tensors="pt")
    pixels, grid = vision["pixel_values"], vision["image_grid_thw"]
    depth = fused.config.vision_config.depth
    with torch.no_grad():
        want = model.model.get_image_features(pixels, grid)
        before = _counts()
        with pointwise_fused():
            got = fused.model.get_image_features(pixels, grid)
    assert _counts()["rotary_vision"] - before.get("rotary_vision", 0) == depth
    for a, b in zip(_tensors(got), _tensors(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _tensors(out) -> list[torch.Tensor]:
    """The tensors of an output (a tensor, a tuple or list of them, or a model output)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for item in out for t in _tensors(item)]


def test_the_engine_with_fused_pointwise_samples_what_the_plain_engine_samples(
    tiny, on_cpu
) -> None:
    model, chat = tiny
    rows = generate_rows("maze_2d/small", 2, env_options={"cell_px": 12})
    settings = RolloutSettings(2, 3, 4096, SamplingParams(temperature=1.0, max_tokens=6))

    def run(fused: bool):
        engine = InferenceEngine(
            copy.deepcopy(model), chat, cuda_graphs=True, fused_pointwise=fused
        )
        return play(engine, rows, settings, seed=5)

    before = _counts()
    fused = run(True)
    assert _counts().get("rotary", 0) > before.get("rotary", 0)  # prefill and decode steps
    assert_same_samples(fused, run(False), tol=1e-4)


def test_eager_decode_steps_leave_the_fused_kernels_out(tiny, on_cpu, monkeypatch) -> None:
    # Eager steps (no graphs: enforce_eager, rows with their own adapters) compute a row's
    # few hundred values a layer: the compiled kernels' host cost outweighs them.
    model, chat = tiny
    rows = generate_rows("maze_2d/small", 1, env_options={"cell_px": 12})
    settings = RolloutSettings(2, 2, 4096, SamplingParams(temperature=1.0, max_tokens=6))
    seen: list[bool] = []
    forward = batch_module.CacheBatch._forward

    def recording(batch, ids, pos, mask, rows=None, fused=True, **extra):
        if ids.shape[1] == 1 and rows is None:  # a decode step
            seen.append(fused)
        return forward(batch, ids, pos, mask, rows, fused, **extra)

    monkeypatch.setattr(batch_module.CacheBatch, "_forward", recording)
    engine = InferenceEngine(copy.deepcopy(model), chat, cuda_graphs=False, fused_pointwise=True)
    before = _counts().get("rotary", 0)
    play(engine, rows, settings, seed=5)
    assert seen and not any(seen)  # every eager decode step, unfused
    assert _counts().get("rotary", 0) > before  # the prefills still fused
    seen.clear()
    graphed = InferenceEngine(copy.deepcopy(model), chat, cuda_graphs=True, fused_pointwise=True)
    play(graphed, rows, settings, seed=5)
    assert seen and all(seen)  # the fixed-shape (on CUDA, graphed) steps fused


def test_a_failed_compilation_warns_and_the_kernel_stays_eager(monkeypatch, on_cpu) -> None:
    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no backend")

        return call

    monkeypatch.setattr(fused_pointwise.torch, "compile", broken)
    monkeypatch.setattr(fused_pointwise, "_eager_only", set())
    x = torch.randn(4, 8)
    with pointwise_fused(), pytest.warns(RuntimeWarning, match="compiling the fused probe"):
        out = fused_pointwise._fused("probe", silu_mul, x, x)
    torch.testing.assert_close(out, silu_mul(x, x))
    assert "probe" in fused_pointwise._eager_only
    with pointwise_fused():
        torch.testing.assert_close(fused_pointwise._fused("probe", silu_mul, x, x), out)


def test_a_config_key_turns_it_off_and_it_is_on_by_default() -> None:
    from clew.config import load_config

    assert load_config(None).generator.inference_engine.fused_pointwise is True
    cfg = load_config(None, ["generator.inference_engine.fused_pointwise=false"])
    assert cfg.generator.inference_engine.fused_pointwise is False


@pytest.mark.gpu
def test_on_cuda_the_fused_kernels_run_in_graph_steps_and_keep_the_logits(
    tmp_path: Path,
) -> None:
    build_model("tiny", tmp_path, arch="qwen3_vl", image_size=224, overwrite=True)
    model, processor = load_policy(tmp_path, dtype="bfloat16", device=torch.device("cuda"))
    model.eval()
    chat = ChatFormat(processor)
    ids = torch.tensor([chat.encode_text("go left then down") * 4], device="cuda")
    fused = copy.deepcopy(model)
    fuse_pointwise(fused)
    with torch.no_grad(), pointwise_fused():
        got = fused(input_ids=ids).logits.float()
    want = model(input_ids=ids).logits.float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()  # bf16: rounded once, not six times
    rows = generate_rows("maze_2d/small", 3, env_options={"cell_px": 32})
    settings = RolloutSettings(3, 3, 4096, SamplingParams(temperature=1.0, max_tokens=6))
    before = _counts()
    engine = InferenceEngine(fused, chat, cuda_graphs=True, fused_pointwise=True)
    trajs = play(engine, rows, settings, seed=5)
    assert all(t.turns >= 1 for t in trajs)
    assert _counts().get("rotary", 0) > before.get("rotary", 0)
