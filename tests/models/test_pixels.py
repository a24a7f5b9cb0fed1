"""Tests for clew.models.pixels against both of transformers' Qwen-VL image processors.

The fast path must give each processor's own pixel values and grids, bit for bit: the PIL
one (``Qwen2VLImageProcessorPil``, clew's everywhere) and the torchvision-backed one
(``Qwen2VLImageProcessor`` where torchvision is installed, as on the GPU image), which
resizes and normalises differently. The torchvision tests are skipped where torchvision is
not importable (beside this project's CPU torch it is not).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from clew.envs import make
from clew.models.frame_cache import frame_cache
from clew.models.pixels import as_patches, cat_pixels, fast_frames, fast_grid, fast_patches
from clew.models.processor import image_processor_kwargs, make_image_processor
from clew.models.torchvision_pixels import interpolation, is_torchvision_processor

# (patch, image_mean / image_std): Qwen2-VL's and Qwen2.5-VL's geometry, and Qwen3-VL's.
GEOMETRIES = {"qwen2_vl": (14, None), "qwen3_vl": (16, 0.5)}
# Frames already at a multiple of patch x merge, and frames the processor resizes: maze
# frames (225 px: 224 at patch 14, 256 at patch 16), odd sizes, non-square, upscaled.
SIZES = [(225, 225), (224, 224), (256, 256), (252, 252), (275, 275), (101, 333), (57, 29)]


def _image(height: int, width: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _kwargs(geometry: str) -> dict[str, Any]:
    patch, norm = GEOMETRIES[geometry]
    mean = None if norm is None else [norm] * 3
    return image_processor_kwargs(patch_size=patch, image_mean=mean, image_std=mean)


def _pil(geometry: str, **extra: Any) -> Any:
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**_kwargs(geometry), **extra)


def _torchvision(geometry: str, **extra: Any) -> Any:
    pytest.importorskip("torchvision")
    from transformers import Qwen2VLImageProcessor

    ip = Qwen2VLImageProcessor(**_kwargs(geometry), **extra)
    assert is_torchvision_processor(ip)
    return ip


MAKERS = {"pil": _pil, "torchvision": _torchvision}


def _assert_same(images: list[Image.Image], ip: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast path covers ``images`` and gives ``ip``'s values, by every entry point."""
    fast = fast_patches(images, ip)
    assert fast is not None, "not covered"
    ref = ip(images=images, return_tensors="pt")
    assert fast[0].dtype == ref["pixel_values"].dtype == torch.float32
    assert torch.equal(fast[0], ref["pixel_values"])
    assert torch.equal(fast[1], ref["image_grid_thw"])
    assert torch.equal(fast_grid(images, ip), ref["image_grid_thw"])
    assert torch.equal(as_patches(fast_frames(images, ip)), ref["pixel_values"])
    return fast


@pytest.mark.parametrize("backend", list(MAKERS))
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize(("height", "width"), SIZES)
def test_fast_patches_equal_the_processor_bit_for_bit(
    backend: str, geometry: str, height: int, width: int
) -> None:
    ip = MAKERS[backend](geometry)
    images = [_image(height, width, seed) for seed in range(3)]
    _assert_same(images, ip)


@pytest.mark.parametrize("backend", list(MAKERS))
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_maze_frames_equal_the_processor(backend: str, geometry: str) -> None:
    env = make("maze_2d/easy")
    frames = [env.reset(seed).images[0] for seed in range(3)]
    assert frames[0].size == (225, 225)  # resized by both geometries
    _, grid = _assert_same(frames, MAKERS[backend](geometry))
    assert int(grid[0, 1]) * GEOMETRIES[geometry][0] != 225


def _modes(side: int) -> dict[str, Image.Image]:
    rng = np.random.default_rng(7)
    rgba = Image.fromarray(rng.integers(0, 256, (side, side, 4), dtype=np.uint8), "RGBA")
    rgb = _image(side, side, 3)
    palette = rgb.quantize(64)
    transparent = palette.copy()
    transparent.info["transparency"] = 5
    return {
        "L": rgb.convert("L"),
        "RGBA": rgba,
        "LA": rgba.convert("LA"),
        "P": palette,
        "P+transparency": transparent,
        "1": rgb.convert("1"),
    }


@pytest.mark.parametrize("backend", list(MAKERS))
@pytest.mark.parametrize("side", [224, 225])
@pytest.mark.parametrize("mode", ["L", "RGBA", "LA", "P", "P+transparency", "1"])
def test_other_image_modes_are_converted_as_the_processor_converts_them(
    backend: str, side: int, mode: str
) -> None:
    ip = MAKERS[backend]("qwen2_vl")
    image = _modes(side)[mode]
    _assert_same([image, image.copy()], ip)


@pytest.mark.parametrize("backend", list(MAKERS))
def test_without_rgb_conversion_only_rgb_frames_are_covered(backend: str) -> None:
    ip = MAKERS[backend]("qwen2_vl", do_convert_rgb=False)
    assert fast_patches([_image(225, 225).convert("RGBA")], ip) is None
    _assert_same([_image(225, 225)], ip)


@pytest.mark.parametrize("backend", list(MAKERS))
def test_what_the_fast_path_leaves_to_the_processor(backend: str) -> None:
    ip = MAKERS[backend]("qwen2_vl")
    assert fast_patches([], ip) is None
    assert fast_patches([_image(224, 224), _image(252, 252)], ip) is None  # mixed sizes
    assert fast_patches([_image(224, 224).convert("CMYK")], ip) is None  # a mode it leaves
    assert fast_patches([_image(2, 600)], ip) is None  # the processor refuses the ratio


def test_a_resize_interpolate_has_no_mode_for_is_left_to_the_processor() -> None:
    ip = _torchvision("qwen2_vl", resample=1)  # LANCZOS
    assert interpolation(ip.resample) is None
    assert fast_patches([_image(225, 225)], ip) is None  # resized: left to the processor
    _assert_same([_image(224, 224)], ip)  # kept as it is: covered


def test_interpolation_modes_follow_transformers_mapping() -> None:
    assert [interpolation(r) for r in range(6)] == [
        "nearest-exact",
        None,
        "bilinear",
        "bicubic",
        None,
        None,
    ]


@pytest.mark.parametrize("resample", [0, 2])
def test_other_resize_filters_equal_the_torchvision_processor(resample: int) -> None:
    ip = _torchvision("qwen2_vl", resample=resample)
    _assert_same([_image(225, 225, seed) for seed in range(2)], ip)


def test_both_processors_resizes_of_one_frame_stay_apart() -> None:
    # The frame cache keys a resize by its filter: Pillow's and torchvision's bicubic resizes
    # of the same frame differ and must not be served for each other.
    pil, tvp = _pil("qwen2_vl"), _torchvision("qwen2_vl")
    frame = _image(225, 225, 11)
    frame_cache.clear()
    for ip in (pil, tvp, pil, tvp):
        _assert_same([frame, frame.copy()], ip)
    a, b = fast_frames([frame], pil), fast_frames([frame], tvp)
    assert not torch.equal(a.data, b.data)  # the resizes really differ
    joined = cat_pixels([a, b])  # different tables: joined as patches, each its own values
    ref = torch.cat([p(images=[frame], return_tensors="pt")["pixel_values"] for p in (pil, tvp)])
    assert torch.equal(joined, ref)


def test_a_processor_loaded_by_transformers_is_covered(tmp_path: Path) -> None:
    # Loaded by AutoImageProcessor (not clew's loader), a saved Qwen-VL image processor is
    # the torchvision-backed class where torchvision is installed.
    pytest.importorskip("torchvision")
    make_image_processor(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(
        tmp_path
    )
    ip = AutoImageProcessor.from_pretrained(tmp_path)
    assert is_torchvision_processor(ip)
    env = make("maze_2d/easy")
    _assert_same([env.reset(seed).images[0] for seed in range(2)], ip)


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_the_pil_processor_is_not_taken_for_a_torchvision_one(geometry: str) -> None:
    assert not is_torchvision_processor(_pil(geometry))
    assert not is_torchvision_processor(make_image_processor())
