"""Tests for clew.kernels.vision_attention: one attention call for same-size images."""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import clew.kernels.vision_attention as va
from clew.kernels.vision_attention import batch_vision_attention
from clew.models import build_model
from clew.models.chat import ChatFormat


def _images(sizes: list[int]) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (s, s, 3), dtype=np.uint8)) for s in sizes]


def _features(model: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(pixels, grid)
    out = getattr(out, "pooler_output", out)
    return torch.cat(list(out)) if isinstance(out, (list, tuple)) else out


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_vl"])
@pytest.mark.parametrize("sizes", [[84] * 5, [84], [84, 56, 84]])
def test_batched_vision_attention_gives_the_per_image_features(
    tmp_path: Path, arch: str, sizes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    built = build_model(
        "tiny", tmp_path / "m", image_size=84, patch_size=14, merge_size=1, arch=arch
    )
    pixels, grid = ChatFormat(built.processor).encode_images(_images(sizes))
    batched = copy.deepcopy(built.model)
    assert batch_vision_attention(batched) == 1  # the tiny preset's one vision layer
    assert batch_vision_attention(batched) == 0  # wrapping twice is a no-op
    calls: list[torch.Size] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return sdpa(*args, **kwargs)

    reference = _features(built.model, pixels, grid)
    # torch.nn.functional is one module: the spy sees transformers' per-image calls too.
    monkeypatch.setattr(va.F, "scaled_dot_product_attention", spy)
    ours = _features(batched, pixels, grid)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    if len(set(sizes)) == 1:
        assert calls == [torch.Size([len(sizes), 4, 36, 32])]  # one call for all images
    else:
        assert [c[0] for c in calls] == [1] * len(sizes)  # image by image, as transformers


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_vl"])
def test_shared_vision_positions_give_the_same_features_from_one_image_s_ids(
    tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers.vision_utils as vu

    built = build_model(
        "tiny", tmp_path / "m", image_size=84, patch_size=14, merge_size=1, arch=arch
    )
    chat = ChatFormat(built.processor)
    pixels, grid = chat.encode_images(_images([84] * 6))
    grids: list[int] = []
    real = vu.get_vision_position_ids

    def spy(grid_thw, *args, **kwargs):
        if "position_ids" not in (kwargs.get("kwargs") or {}):  # built, not handed in
            grids.append(len(grid_thw))
        return real(grid_thw, *args, **kwargs)

    # The spy stands where the tower and clew both look the helper up.
    tower = importlib.import_module(type(built.model.model.visual).__module__)
    monkeypatch.setattr(vu, "get_vision_position_ids", spy)
    monkeypatch.setattr(tower, "get_vision_position_ids", spy)
    shared = copy.deepcopy(built.model)
    assert va.share_vision_positions(shared)
    assert not va.share_vision_positions(shared)  # wrapping twice is a no-op
    reference = _features(built.model, pixels, grid)
    assert grids == [6]
    ours = _features(shared, pixels, grid)
    ours_again = _features(shared, pixels, grid)
    assert grids == [6, 1]  # one image's ids, computed once and kept
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    torch.testing.assert_close(ours_again, reference, rtol=0, atol=0)
    # Mixed sizes go through transformers' own per-image path.
    mixed_pixels, mixed_grid = chat.encode_images(_images([84, 56]))
    torch.testing.assert_close(
        _features(shared, mixed_pixels, mixed_grid),
        _features(built.model, mixed_pixels, mixed_grid),
        rtol=0,
        atol=0,
    )

    # A deepcopy (the KL reference) runs its own weights, not the wrapped original's.
    twin = copy.deepcopy(shared)
    with torch.no_grad():
        for p in shared.model.visual.parameters():
            p.add_(0.5)
    torch.testing.assert_close(_features(twin, pixels, grid), reference, rtol=0, atol=0)


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of a tensor's value to the host (``item``, ``int``, ``tolist``): on a GPU
    each waits for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_vl"])
def test_the_images_lengths_are_read_to_the_host_once_a_forward_not_once_a_layer(
    tmp_path: Path, arch: str
) -> None:
    reads = {}
    for depth in (1, 4):
        built = build_model(
            "tiny", tmp_path / f"m{depth}", image_size=84, patch_size=14, merge_size=1,
            arch=arch, vision_overrides={"depth": depth}, overwrite=True,
        )  # fmt: skip
        model = built.model
        assert batch_vision_attention(model) == depth
        pixels, grid = ChatFormat(built.processor).encode_images(_images([84] * 3))
        counter = _HostReads()
        with counter:
            _features(model, pixels, grid)
        reads[depth] = counter.reads
    assert reads[4] == reads[1]  # three more layers, no more waits for the device
