"""A turn's vision tower through fixed-shape buckets of distinct frames
(``clew.inference.vision_graphs``): the bucketed tower gives what the tower's own forward
gives, padding frames change no real frame, and a tower that does not take its positions
precomputed turns the graphs off with a warning instead of giving other numbers."""

from __future__ import annotations

import pytest
import torch
from support.engine_cases import (  # noqa: F401 (fixture)
    assert_same_until_they_part,
    cuda_policy,
    maze_policy,
)
from support.rollout_cases import assert_same_samples, ending_at_different_turns

import clew.inference.vision_graphs as vision_graphs
from clew.config import load_config
from clew.config.settings import engine_options
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.inference.vision_graphs import VisionGraphs
from clew.models.distinct_images import images_deduplicated
from clew.rollout.loop import RolloutSettings, play


def _play(engine, rows, temperature=1.0):
    settings = RolloutSettings(
        n_samples_per_prompt=3,  # 9 rows, fewer as episodes end: buckets with padding frames
        max_turns=4,
        max_input_length=4096,
        sampling=SamplingParams(temperature=temperature, max_tokens=6),
        keep_last_k_images=1,
        env_workers=1,
    )
    return play(engine, rows, settings, seed=3, env_factory=ending_at_different_turns())


def _engine(model, chat, graphs: bool):
    return InferenceEngine(
        model, chat, prefill_attention="sdpa", fused_pointwise=False, max_cache_bytes=2**30,
        vision_graphs=graphs,
    )  # fmt: skip


def _frames(model, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random frames of one grid, as the tower takes them."""
    visual = model.model.visual
    cfg = visual.config
    side = 4
    per = side * side
    values = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, side, side]] * n)
    return torch.randn(n * per, values, generator=g), grid


def test_the_bucketed_tower_gives_the_tower_s_own_output_for_every_frame(maze_policy):  # noqa: F811
    model, _, _ = maze_policy
    if not hasattr(model.model.visual, "deepstack_merger_list"):
        pytest.skip("the graphs take Qwen3-VL's tower; Qwen2-VL's runs eagerly")
    visual = model.model.visual
    graphs = VisionGraphs(capture=False)
    for n in (3, 5):  # buckets of 4 and 16 frames: padding frames in both
        pixels, grid = _frames(model, n, seed=n)
        with torch.no_grad(), images_deduplicated():
            with graphs.routed():
                ours = visual(pixels, grid_thw=grid)
            theirs = visual(pixels, grid_thw=grid)
        assert graphs.enabled
        torch.testing.assert_close(ours.pooler_output, theirs.pooler_output)
        for a, b in zip(ours.deepstack_features, theirs.deepstack_features, strict=True):
            torch.testing.assert_close(a, b)
    assert graphs.replays == 2 and {s[0] for s in graphs.shapes} == {4, 8}


def test_a_rollout_through_the_vision_buckets_samples_what_the_plain_tower_samples(
    maze_policy,  # noqa: F811
):
    model, chat, rows = maze_policy
    engine = _engine(model, chat, graphs=True)
    bucketed = _play(engine, rows)
    plain = _play(_engine(model, chat, graphs=False), rows)
    assert_same_samples(bucketed, plain, tol=1e-5)
    if hasattr(model.model.visual, "deepstack_merger_list"):
        assert engine.vision_graphs.enabled and engine.vision_graphs.replays >= 4
    else:  # Qwen2-VL's tower works out its positions itself: the graphs stood aside
        assert not engine.vision_graphs.enabled


def test_a_tower_whose_output_differs_turns_the_graphs_off_and_runs_eagerly(
    maze_policy,  # noqa: F811
    monkeypatch,
):
    model, chat, rows = maze_policy
    if not hasattr(model.model.visual, "deepstack_merger_list"):
        pytest.skip("the graphs take Qwen3-VL's tower")
    real = vision_graphs._precomputed

    def shifted(tower, grid):  # a position table read backwards: another output
        given = real(tower, grid)
        given["interp_indices"] = given["interp_indices"].flip(0)
        return given

    monkeypatch.setattr(vision_graphs, "_precomputed", shifted)
    engine = _engine(model, chat, graphs=True)
    with pytest.warns(UserWarning, match="differs from the tower's own forward"):
        checked = _play(engine, rows, temperature=0.0)
    assert not engine.vision_graphs.enabled and engine.vision_graphs.replays == 0
    assert_same_samples(checked, _play(_engine(model, chat, graphs=False), rows, 0.0), tol=1e-5)


def test_a_capture_that_fails_turns_the_graphs_off_and_the_tower_runs_eagerly(
    maze_policy,  # noqa: F811
    monkeypatch,
):
    model, _, _ = maze_policy
    if not hasattr(model.model.visual, "deepstack_merger_list"):
        pytest.skip("the graphs take Qwen3-VL's tower")

    def failing(run, pool):  # what torch raises for an operation a capture cannot record
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(vision_graphs, "captured", failing)
    graphs = VisionGraphs(capture=True)
    graphs._pool = ()  # the capture itself fails, not the memory pool's creation
    visual = model.model.visual
    pixels, grid = _frames(model, 1)
    with torch.no_grad(), images_deduplicated():
        with graphs.routed(), pytest.warns(UserWarning, match="its capture failed"):
            ours = visual(pixels, grid_thw=grid)
        theirs = visual(pixels, grid_thw=grid)
    assert not graphs.enabled and graphs.captures == 0
    torch.testing.assert_close(ours.pooler_output, theirs.pooler_output)


def test_vision_graphs_come_from_the_config_and_enforce_eager_turns_them_off():
    key = "generator.inference_engine.vision_cuda_graphs=true"
    assert engine_options(load_config(None, [key])).vision_cuda_graphs is True
    eager = load_config(None, [key, "generator.inference_engine.enforce_eager=true"])
    assert engine_options(eager).vision_cuda_graphs is False


@pytest.mark.gpu
def test_captured_vision_graphs_sample_what_the_eager_tower_samples_and_replay_later():
    model, chat, rows = cuda_policy()
    engine = _engine(model, chat, graphs=True)
    graphed = _play(engine, rows, temperature=0.0)
    graphs = engine.vision_graphs
    assert graphs.enabled and graphs.captures >= 2
    eager = _play(_engine(model, chat, graphs=False), rows, temperature=0.0)
    # bfloat16 over other shapes: the same replies until a near tie parts them.
    assert_same_until_they_part(graphed, eager, tol=2e-2)
    captured = graphs.captures
    again = _play(engine, rows, temperature=0.0)
    assert graphs.captures == captured  # the same buckets replayed, none new
    assert_same_samples(again, graphed, tol=1e-6)
    # One maze's samples show one distinct frame a turn: buckets of a single frame, whose
    # attention reads no length back to the host either.
    single = _play(engine, rows[:1], temperature=0.0)
    assert graphs.enabled and 1 in {shape[0] for shape in graphs.shapes}
    alone = _play(_engine(model, chat, graphs=False), rows[:1], temperature=0.0)
    assert_same_until_they_part(single, alone, tol=2e-2)
