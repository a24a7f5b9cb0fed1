"""Each distinct image of a forward through the vision tower once
(``clew.models.distinct_images``; always, in the engine's forwards)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from support.rollout_cases import assert_same_samples, ending_at_different_turns

import clew.models.distinct_images as di
from clew.inference import cache_batch
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import build_model
from clew.models.chat import ChatFormat
from clew.models.distinct_images import (
    IMAGES,
    dedup_vision_images,
    distinct_rows,
    images_deduplicated,
)
from clew.rollout.loop import RolloutSettings, play


def _frames(picks: list[int], size: int = 84) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    pool = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(max(picks) + 1)]
    return [Image.fromarray(pool[i]) for i in picks]


def test_distinct_rows_keeps_the_first_of_each_and_maps_every_row_to_it():
    rows = torch.randn(4, 50)
    flat = rows[[2, 0, 2, 1, 0, 3]]
    firsts, index = distinct_rows(flat)
    assert firsts.tolist() == [0, 1, 3, 5]
    assert index.tolist() == [0, 1, 0, 2, 1, 3]
    assert torch.equal(flat[firsts][index], flat)
    assert distinct_rows(rows) is None  # nothing to save


def test_rows_that_share_a_signature_but_differ_are_not_merged(monkeypatch):
    flat = torch.randn(3, 10)
    monkeypatch.setattr(di, "_signatures", lambda f: [(1.0, 2.0)] * len(f))
    assert distinct_rows(flat) is None
    firsts, index = distinct_rows(flat[[1, 1, 1]])  # equal rows still merge
    assert firsts.tolist() == [0] and index.tolist() == [0, 0, 0]


def test_a_one_pixel_difference_keeps_two_images_apart():
    a = np.zeros((84, 84, 3), dtype=np.uint8)
    b = a.copy()
    b[40, 40, 1] = 1
    flat = torch.from_numpy(np.stack([a, b, a]).astype(np.float32)).reshape(3, -1)
    firsts, index = distinct_rows(flat)
    assert firsts.tolist() == [0, 1] and index.tolist() == [0, 1, 0]


def _features(model: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor):
    with torch.no_grad():
        out = model.model.get_image_features(pixels, grid)
    pooled = torch.cat(list(getattr(out, "pooler_output", out)))
    deep = [torch.cat(list(f)) for f in getattr(out, "deepstack_features", None) or []]
    return pooled, deep


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_vl"])
def test_the_tower_runs_on_the_distinct_images_and_gives_every_copy_its_output(
    tmp_path: Path, arch: str
) -> None:
    built = build_model(
        "tiny", tmp_path / "m", image_size=84, patch_size=14, merge_size=1, arch=arch
    )
    chat = ChatFormat(built.processor)
    pixels, grid = chat.encode_images(_frames([0, 1, 0, 2, 1, 0]))
    wrapped = copy.deepcopy(built.model)
    dedup_vision_images(wrapped)  # once more: loading wrapped it already
    assert not dedup_vision_images(wrapped)
    reference, ref_deep = _features(built.model, pixels, grid)
    IMAGES.reset()
    ours, deep = _features(wrapped, pixels, grid)  # outside the switch: unchanged
    assert (IMAGES.seen, IMAGES.encoded) == (0, 0)
    with images_deduplicated():
        ours, deep = _features(wrapped, pixels, grid)
    assert (IMAGES.seen, IMAGES.encoded) == (6, 3)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    assert len(deep) == len(ref_deep) and (arch == "qwen2_vl" or deep)  # Qwen3-VL's deepstack
    for a, b in zip(deep, ref_deep, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Images of several sizes go to the tower as they are.
    mixed, mixed_grid = chat.encode_images(_frames([0, 0], 84) + _frames([0], 56))
    IMAGES.reset()
    with images_deduplicated():
        got, _ = _features(wrapped, mixed, mixed_grid)
    assert IMAGES.encoded == 3
    torch.testing.assert_close(got, _features(built.model, mixed, mixed_grid)[0])

    # A deep copy (the KL reference) runs its own weights, not the wrapped original's.
    twin = copy.deepcopy(wrapped)
    with torch.no_grad():
        for p in wrapped.model.visual.parameters():
            p.add_(0.5)
    with images_deduplicated():
        torch.testing.assert_close(_features(twin, pixels, grid)[0], reference)


def _play(model, chat, rows):
    settings = RolloutSettings(
        n_samples_per_prompt=3,
        max_turns=4,
        max_input_length=4096,
        sampling=SamplingParams(temperature=1.0, max_tokens=6),
        env_workers=1,
    )
    engine = InferenceEngine(model, chat)
    return play(engine, rows, settings, seed=3, env_factory=ending_at_different_turns())


def test_an_engine_that_encodes_each_distinct_image_once_samples_what_one_encoding_all_does(
    maze_policy,
    monkeypatch,
):
    model, chat, rows = maze_policy
    IMAGES.reset()
    deduplicated = _play(model, chat, rows)
    seen, encoded = IMAGES.seen, IMAGES.encoded
    # The 3 samples of each prompt start from one frame: at most a third of those encoded.
    assert seen > 0 and encoded < seen
    # The switch off in the engine's forwards: the tower runs on every image, copies too.
    monkeypatch.setattr(cache_batch, "images_deduplicated", lambda: images_deduplicated(False))
    IMAGES.reset()
    every = _play(model, chat, rows)
    assert IMAGES.seen == 0
    assert_same_samples(deduplicated, every, tol=1e-5)
