"""Qwen-VL pixel patches for a batch of same-size images, in one vectorised pass.

The Qwen2-VL image processor (the PIL one: clew runs without torchvision) encodes image by
image in Python: about 0.6 ms per 126 px image, which made image encoding the largest
host-side cost of an SFT step on the GPU (0.58 s of a 2.6 s step at 64 demonstrations,
profiled on an H200) and capped demonstration building at 40 per second. Maze frames
are all the same size, so what the processor does (resize to a multiple of patch x merge,
rescale, normalise, cut into patches, repeat each patch over the temporal axis) is one
resize per frame, a table lookup and one copy over the whole stack. This module does
exactly those, in the processor's own order and layout; for anything it does not cover
(mixed sizes, a non-RGB image, a processor without these settings) it returns ``None`` and
the caller uses the processor. ``tests/test_models.py`` checks the output against the
processor's, value for value.

The resize matters for Qwen3-VL: its patch 16 x merge 2 does not divide the 252 px frames
of ``maze_2d/easy`` (cells of 28 px), so the processor resizes each to 256 px, and that
path through the processor took 3 ms a frame, 36% of an 8B rollout's wall time on an H100
(``benchmarks/rollout.py --profile``: "outside the engine"). The processor resizes the
uint8 frame with Pillow (``transformers.image_transforms.resize``) to ``smart_resize``'s
size before rescaling; this module calls the same two. Whether they give the processor's
values is checked once per processor and size on a random probe image (``_resize_agrees``);
a processor that resizes any other way (a torchvision one) is left to itself.

A frame shown again (the samples of a prompt start alike, a refused move shows the same
frame) is resized once: ``clew.models.frame_cache`` keeps resized frames by content.

The bytes can also wait (``Frames``): training batches and the rollout engine carry frames
as uint8 and patch them on the device that runs the model, where the lookup and the copy
cost next to nothing, instead of building and moving 8x as many float bytes on the host.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from PIL import Image

from clew.models.frame_cache import frame_cache

__all__ = [
    "Frames",
    "Pixels",
    "as_patches",
    "cat_pixels",
    "fast_frames",
    "fast_grid",
    "fast_patches",
]


def _pixel_bounds(ip: Any) -> tuple[int, int] | None:
    size = getattr(ip, "size", None)
    lo = getattr(size, "shortest_edge", None) if size is not None else None
    hi = getattr(size, "longest_edge", None) if size is not None else None
    if isinstance(size, dict):
        lo, hi = size.get("shortest_edge"), size.get("longest_edge")
    lo = lo if lo is not None else getattr(ip, "min_pixels", None)
    hi = hi if hi is not None else getattr(ip, "max_pixels", None)
    return (int(lo), int(hi)) if lo is not None and hi is not None else None


def _resized(
    ip: Any, height: int, width: int, factor: int, lo: int, hi: int
) -> tuple[int, int] | None:
    """The (height, width) the processor resizes a frame to, by its own module's
    ``smart_resize``; without one, the frame's size if ``smart_resize`` would keep it
    (both sides multiples of the factor, the pixel count in [lo, hi]), else ``None``."""
    for cls in type(ip).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "smart_resize", None)
        if callable(fn):
            return tuple(fn(height, width, factor=factor, min_pixels=lo, max_pixels=hi))
    keeps = height % factor == 0 and width % factor == 0 and lo <= height * width <= hi
    return (height, width) if keeps else None


# Per image processor: {(height, width): whether Pillow's resize gives its values}.
_RESIZE_CHECKS: weakref.WeakKeyDictionary[Any, dict[tuple[int, int], bool]] = (
    weakref.WeakKeyDictionary()
)


def _resize_agrees(ip: Any, height: int, width: int, size: tuple[int, int]) -> bool:
    """Whether ``_resize`` to ``size`` then the byte table give ``ip``'s own pixel values
    for a ``height`` x ``width`` frame, checked once on a random probe image."""
    try:
        checks = _RESIZE_CHECKS.setdefault(ip, {})
    except TypeError:  # not weakly referable: check every time rather than never
        checks = {}
    if (height, width) not in checks:
        rng = np.random.default_rng(0)
        probe = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        patch, merge, temporal, scale, mean, std = _settings(ip)  # type: ignore[misc]
        table = _byte_table(scale, tuple(mean.tolist()), tuple(std.tolist()))
        raw = np.asarray(_resize(probe, size, ip), dtype=np.uint8)[None]
        ours = _patch_numpy(raw, table.numpy(), patch, merge, temporal)
        try:
            theirs = ip(images=[probe], return_tensors="pt")["pixel_values"]
        except Exception:  # noqa: BLE001 - a processor that cannot run the probe is not covered
            checks[(height, width)] = False
        else:
            checks[(height, width)] = torch.equal(torch.from_numpy(ours), theirs)
    return checks[(height, width)]


def _resample(ip: Any) -> int:
    resample = getattr(ip, "resample", None)
    return 3 if resample is None else int(resample)  # 3: bicubic, the processor's default


def _resize(image: Image.Image, size: tuple[int, int], ip: Any) -> Image.Image:
    """``image`` at ``size`` (height, width) as the PIL image processor resizes it."""
    if image.size == (size[1], size[0]):
        return image
    return image.resize((size[1], size[0]), resample=_resample(ip))


def _frame(image: Image.Image, size: tuple[int, int], ip: Any) -> np.ndarray:
    """``_resize``'s pixels as uint8, resized once per distinct frame
    (``clew.models.frame_cache``)."""
    if image.size == (size[1], size[0]):
        return np.asarray(image, dtype=np.uint8)
    return frame_cache.resized(image, size, _resample(ip), lambda: _resize(image, size, ip))


def _settings(ip: Any) -> tuple[int, int, int, float, np.ndarray, np.ndarray] | None:
    try:
        patch = int(ip.patch_size)
        merge = int(ip.merge_size)
        temporal = int(ip.temporal_patch_size)
        scale = float(ip.rescale_factor)
        mean = np.asarray(ip.image_mean, dtype=np.float32)
        std = np.asarray(ip.image_std, dtype=np.float32)
        flags = (ip.do_rescale, ip.do_normalize)
    except (AttributeError, TypeError, ValueError):
        return None
    return (patch, merge, temporal, scale, mean, std) if flags == (True, True) else None


def _covered(images: list[Image.Image], ip: Any) -> tuple[tuple[Any, ...], tuple[int, int]] | None:
    """The processor's settings and the (height, width) it resizes ``images`` to, when the
    fast path covers them, else ``None``."""
    settings, bounds = _settings(ip), _pixel_bounds(ip)
    if not images or settings is None or bounds is None:
        return None
    width, height = images[0].size
    if any(im.mode != "RGB" or im.size != (width, height) for im in images):
        return None
    patch, merge = settings[0], settings[1]
    try:
        size = _resized(ip, height, width, patch * merge, *bounds)
    except ValueError:  # a frame the processor itself refuses (aspect ratio, too small)
        return None
    if size is None:
        return None
    if size != (height, width) and not _resize_agrees(ip, height, width, size):
        return None
    return settings, size


def _grid(count: int, size: tuple[int, int], patch: int) -> torch.Tensor:
    height, width = size
    return torch.tensor([[1, height // patch, width // patch]] * count, dtype=torch.int64)


def fast_grid(images: list[Image.Image], ip: Any) -> torch.Tensor | None:
    """``image_grid_thw [N, 3]`` of images the fast path covers (else ``None``), without pixels.

    What a caller needs that only counts image tokens (building SFT demonstrations).
    """
    covered = _covered(images, ip)
    return None if covered is None else _grid(len(images), covered[1], covered[0][0])


def fast_frames(images: list[Image.Image], ip: Any) -> Frames | None:
    """The images as ``Frames`` (bytes, patched where they are used), or ``None`` if not covered."""
    covered = _covered(images, ip)
    if covered is None:
        return None
    (patch, merge, temporal, scale, mean, std), size = covered
    table = _byte_table(scale, tuple(mean.tolist()), tuple(std.tolist()))
    raw = np.stack([_frame(im, size, ip) for im in images])
    return Frames(torch.from_numpy(raw), table, patch, merge, temporal)  # raw: [N, H, W, C]


@lru_cache(maxsize=8)
def _byte_table(scale: float, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """float32 ``[C, 256]``: the processor's value of each byte, per channel (read only).

    The processor's arithmetic (rescale in float64, cast to float32, normalise in float32)
    has one result per channel and byte value: the table gives the same floats, bit for
    bit, with one lookup per pixel. Built once per setting: rollouts encode one frame a turn.
    """
    levels = (np.arange(256, dtype=np.float64) * scale).astype(np.float32)
    m, sd = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
    return torch.from_numpy((levels[None, :] - m[:, None]) / sd[:, None])


def fast_patches(images: list[Image.Image], ip: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(pixel_values [N * gh * gw, C * T * P * P], image_grid_thw [N, 3])`` or ``None``."""
    frames = fast_frames(images, ip)
    if frames is None:
        return None
    size = (int(frames.data.shape[1]), int(frames.data.shape[2]))
    return frames.patches(), _grid(len(frames), size, frames.patch)


@dataclass(frozen=True)
class Frames:
    """Same-size RGB frames kept as bytes until the device that runs the model patches them.

    A frame's patches are 4 bytes per value and repeated ``temporal`` times: 8x its bytes
    for Qwen-VL. An SFT batch of 64 demonstrations holds about 1,200 frames, 0.47 GB of
    patches against 59 MB of bytes; building, concatenating and copying the patches on the
    host was most of an SFT step (``benchmarks/sft_inputs.py``). ``patches`` gives exactly the
    processor's values.
    """

    data: torch.Tensor  # uint8 [N, H, W, C]
    table: torch.Tensor  # float32 [C, 256]: the processor's value of each byte, per channel
    patch: int
    merge: int
    temporal: int

    def __len__(self) -> int:
        return int(self.data.shape[0])

    def patches(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``pixel_values [N * gh * gw, C * T * P * P]`` float32 on ``device``."""
        shape = (self.patch, self.merge, self.temporal)
        if device is None or torch.device(device).type == "cpu":
            # numpy's strided copy is about twice torch's on a CPU for this layout.
            return torch.from_numpy(_patch_numpy(self.data.numpy(), self.table.numpy(), *shape))
        return _patch_torch(self.data.to(device), self.table.to(device), *shape)

    def compatible(self, other: Frames) -> bool:
        return (
            self.data.shape[1:] == other.data.shape[1:]
            and (self.patch, self.merge, self.temporal)
            == (other.patch, other.merge, other.temporal)
            and torch.equal(self.table, other.table)
        )


Pixels = torch.Tensor | Frames
"""An image stack's pixels: the model's patches, or ``Frames`` still to be patched."""


def as_patches(pixels: Pixels, device: torch.device | str | None = None) -> torch.Tensor:
    """The model's ``pixel_values`` on ``device``, patching ``Frames`` there."""
    return pixels.patches(device) if isinstance(pixels, Frames) else pixels.to(device)


def cat_pixels(items: Sequence[Pixels]) -> Pixels:
    """Stacks in order; still ``Frames`` when all are compatible ``Frames``, else patches."""
    if not items:
        raise ValueError("no pixels to concatenate")
    first = items[0]
    if isinstance(first, Frames) and all(
        isinstance(f, Frames) and first.compatible(f) for f in items
    ):
        data = torch.cat([f.data for f in items])  # type: ignore[union-attr]
        return Frames(data, first.table, first.patch, first.merge, first.temporal)
    return torch.cat([as_patches(p) for p in items])


def _patch_numpy(
    raw: np.ndarray, table: np.ndarray, patch: int, merge: int, temporal: int
) -> np.ndarray:
    n, height, width, channels = raw.shape
    x = np.empty((n, channels, height, width), dtype=np.float32)
    for c in range(channels):
        np.take(table[c], raw[..., c], out=x[:, c])
    gh, gw = height // patch, width // patch
    x = x.reshape(n, channels, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 2, 5, 3, 6, 1, 4, 7)  # [N, gh/m, gw/m, m, m, C, P, P]
    x = np.broadcast_to(x[:, :, :, :, :, :, None], (*x.shape[:6], temporal, patch, patch))
    return np.ascontiguousarray(x).reshape(n * gh * gw, -1)


def _patch_torch(
    raw: torch.Tensor, table: torch.Tensor, patch: int, merge: int, temporal: int
) -> torch.Tensor:
    """``_patch_numpy`` where ``raw`` lives (an accelerator), value for value."""
    n, height, width, channels = raw.shape
    x = torch.empty((n, channels, height, width), dtype=torch.float32, device=raw.device)
    for c in range(channels):
        x[:, c] = table[c][raw[..., c].long()]
    gh, gw = height // patch, width // patch
    x = x.reshape(n, channels, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)
    x = x.unsqueeze(6).expand(*x.shape[:6], temporal, patch, patch)
    return x.reshape(n * gh * gw, -1)
