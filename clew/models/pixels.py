"""Qwen-VL pixel patches for a batch of same-size images, in one vectorised pass.

transformers' Qwen2-VL image processors encode image by image in Python: with the PIL one,
image encoding was the largest host-side cost of an SFT step on the GPU and bounded how fast
demonstrations were built; the torchvision-backed one is slower still per maze frame
(``benchmarks/sft_inputs.py``, ``benchmarks/pixel_path.py``).
Maze frames are all the same size, so what the processor does (resize to a multiple of
patch x merge, rescale, normalise, cut into patches, repeat each patch over the temporal
axis) is one resize per frame, a table lookup and one copy over the whole stack. This module
does exactly those, in the processor's own order and layout; for anything it does not cover
(mixed sizes, an image mode it does not convert, a processor without these settings, a
resize it cannot reproduce) it returns ``None`` and the caller uses the processor.
``tests/models/test_models.py`` and ``tests/models/test_pixels.py`` check the output against the
processor's, value for value.

Both of transformers' Qwen2-VL image processor classes are covered (Qwen2.5-VL, Qwen3-VL and
Qwen3.5 use the same two), each with its own arithmetic:

- The PIL one (``Qwen2VLImageProcessorPil``, which clew loads everywhere) resizes the uint8
  frame with Pillow (``transformers.image_transforms.resize``) to ``smart_resize``'s size and
  rescales then normalises (``_byte_table``); this module calls the same Pillow resize.
- The torchvision-backed one (``Qwen2VLImageProcessor`` where torchvision is installed)
  resizes with ``torch.nn.functional.interpolate`` and normalises fused
  (``clew.models.torchvision_pixels``, which says how); this module reproduces both without
  importing torchvision.

Whether a reproduced resize (and, for the torchvision one, every path) gives the processor's
values is checked once per processor and frame size on a random probe image (``_agrees``);
where it does not, those frames are left to the processor. The resize matters for Qwen3-VL:
its patch 16 x merge 2 does not divide the 252 px frames of ``maze_2d/easy`` (cells of
28 px), so the processor resizes each to 256 px, and that path through the processor was a
large share of an 8B rollout's wall time (``benchmarks/rollout.py --profile``: "outside the
engine"); Qwen2-VL's patch 14 takes 225 px frames to 224 px.

A frame shown again (the samples of a prompt start alike, a refused move shows the same
frame) is resized once: ``clew.models.frame_cache`` keeps resized frames by content.

The bytes can also wait (``Frames``): training batches and the rollout engine carry frames
as uint8 and patch them on the device that runs the model, where the lookup and the copy
cost next to nothing, instead of building and moving 8x as many float bytes on the host.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from clew.models import torchvision_pixels as tv
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

# Modes the processor converts to RGB (with ``do_convert_rgb``) that this module converts
# the same way, by transformers' own ``convert_to_rgb``.
_CONVERTIBLE = frozenset({"1", "L", "LA", "P", "PA", "RGBA"})
# frame_cache keys a resize by an int filter: torchvision resizes go under 256 * (1 + how)
# plus their mode's number, apart from Pillow's filters (0-5).
_TV_CACHE_KEYS = {"nearest-exact": 0, "bilinear": 2, "bicubic": 3}


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


@dataclass(frozen=True)
class _Plan:
    """How the fast path gives ``ip``'s values for frames of one size."""

    size: tuple[int, int]  # (height, width) after the processor's resize
    patch: int
    merge: int
    temporal: int
    convert_rgb: bool
    table: torch.Tensor  # float32 [C, 256]: the processor's value of each byte, per channel
    how: str  # "pil" (Pillow's resize) or one of torchvision_pixels.RESIZES
    resample: int  # Pillow's filter, or (torchvision) the frame cache's key for the resize
    mode: str  # the interpolate mode (torchvision) or ""


# Per image processor: {frame size and settings: the plan for it, or None if not covered}.
_PLANS: weakref.WeakKeyDictionary[Any, dict[Hashable, _Plan | None]] = weakref.WeakKeyDictionary()


def _agrees(ip: Any, height: int, width: int, plan: _Plan) -> bool:
    """Whether ``plan`` gives ``ip``'s own pixel values and grid for a ``height`` x ``width``
    frame, on a random probe image."""
    rng = np.random.default_rng(0)
    probe = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    raw = np.asarray(_resize_image(probe, plan), dtype=np.uint8)[None]
    ours = _patch_numpy(raw, plan.table.numpy(), plan.patch, plan.merge, plan.temporal)
    try:
        theirs = ip(images=[probe], return_tensors="pt")
    except Exception:  # noqa: BLE001 - a processor that cannot run the probe is not covered
        return False
    return torch.equal(torch.from_numpy(ours), theirs["pixel_values"]) and torch.equal(
        _grid(1, plan.size, plan.patch), theirs["image_grid_thw"]
    )


def _resample(ip: Any) -> int:
    resample = getattr(ip, "resample", None)
    return 3 if resample is None else int(resample)  # 3: bicubic, the processor's default


def _resize_image(image: Image.Image, plan: _Plan) -> Image.Image:
    """``image`` (RGB) at ``plan.size`` (height, width), as the processor resizes it."""
    height, width = plan.size
    if image.size == (width, height):
        return image
    if plan.how == "pil":
        return image.resize((width, height), resample=plan.resample)
    return Image.fromarray(tv.resize(np.asarray(image), plan.size, plan.mode, plan.how))


def _frame(image: Image.Image, plan: _Plan) -> np.ndarray:
    """``_resize_image``'s pixels as uint8 ``[H, W, C]``, resized once per distinct frame
    (``clew.models.frame_cache``)."""
    if image.size == (plan.size[1], plan.size[0]):
        return np.asarray(image, dtype=np.uint8)
    return frame_cache.resized(image, plan.size, plan.resample, lambda: _resize_image(image, plan))


def _rgb(image: Image.Image, plan: _Plan) -> Image.Image:
    """``image`` as the processor takes it in: converted to RGB as transformers converts it
    (``do_convert_rgb``: transparency composited on white, in transformers versions that do)."""
    if not plan.convert_rgb or (image.mode == "RGB" and "transparency" not in image.info):
        return image
    try:
        rgb = convert_to_rgb(image, return_numpy=True)
    except TypeError:  # transformers without return_numpy: returns a PIL image
        rgb = convert_to_rgb(image)
    return rgb if isinstance(rgb, Image.Image) else Image.fromarray(np.asarray(rgb))


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


def _takes(image: Image.Image, convert_rgb: bool) -> bool:
    return image.mode == "RGB" or (convert_rgb and image.mode in _CONVERTIBLE)


def _covered(images: list[Image.Image], ip: Any) -> _Plan | None:
    """How to give the processor's values for ``images`` when the fast path covers them,
    else ``None``."""
    settings, bounds = _settings(ip), _pixel_bounds(ip)
    if not images or settings is None or bounds is None:
        return None
    width, height = images[0].size
    convert_rgb = bool(getattr(ip, "do_convert_rgb", False))
    if any(im.size != (width, height) or not _takes(im, convert_rgb) for im in images):
        return None
    patch, merge, temporal, scale, mean, std = settings
    torchvision = tv.is_torchvision_processor(ip)
    resample = getattr(ip, "resample", None)
    do_resize = bool(getattr(ip, "do_resize", True))
    key = (height, width, *settings[:4], tuple(mean), tuple(std), bounds, convert_rgb)
    key += (do_resize, torchvision, resample)
    try:
        plans = _PLANS.setdefault(ip, {})
    except TypeError:  # not weakly referable: work it out every time rather than never
        plans = {}
    if key not in plans:
        factor = patch * merge
        if not do_resize:
            keeps = height % factor == 0 and width % factor == 0
            size = (height, width) if keeps else None
        else:
            try:
                size = _resized(ip, height, width, factor, *bounds)
            except ValueError:  # a frame the processor itself refuses (aspect ratio, too small)
                size = None
        plans[key] = None if size is None else _plan(ip, height, width, size, torchvision)
    return plans[key]


def _plan(
    ip: Any, height: int, width: int, size: tuple[int, int], torchvision: bool
) -> _Plan | None:
    """The plan for ``ip``'s ``height`` x ``width`` frames resized to ``size``, checked on a
    probe where it is not exact by construction (a resize, any torchvision path)."""
    patch, merge, temporal, scale, mean, std = _settings(ip)  # type: ignore[misc]
    convert_rgb = bool(getattr(ip, "do_convert_rgb", False))
    geometry = (size, patch, merge, temporal, convert_rgb)
    if not torchvision:
        table = _byte_table(scale, tuple(mean.tolist()), tuple(std.tolist()))
        plan = _Plan(*geometry, table, "pil", _resample(ip), "")
        return plan if size == (height, width) or _agrees(ip, height, width, plan) else None
    table = tv.byte_table(ip, len(mean))
    mode = tv.interpolation(getattr(ip, "resample", None))
    if table is None or (mode is None and size != (height, width)):
        return None
    for number, how in enumerate(tv.RESIZES):  # whichever way this torchvision resizes
        key = 256 * (1 + number) + _TV_CACHE_KEYS.get(mode or "", 255)
        plan = _Plan(*geometry, table, how, key, mode or "")
        if _agrees(ip, height, width, plan):
            return plan
        if size == (height, width):
            return None  # no resize: the ways do not differ
    return None


def _grid(count: int, size: tuple[int, int], patch: int) -> torch.Tensor:
    return _grid_of(count, size, patch).clone()  # the caller's to keep or change


@lru_cache(maxsize=64)
def _grid_of(count: int, size: tuple[int, int], patch: int) -> torch.Tensor:
    """``_grid``'s value, built once per shape: a rollout encodes one frame an episode a turn."""
    height, width = size
    return torch.tensor([[1, height // patch, width // patch]] * count, dtype=torch.int64)


def fast_grid(images: list[Image.Image], ip: Any) -> torch.Tensor | None:
    """``image_grid_thw [N, 3]`` of images the fast path covers (else ``None``), without pixels.

    What a caller needs that only counts image tokens (building SFT demonstrations).
    """
    plan = _covered(images, ip)
    return None if plan is None else _grid(len(images), plan.size, plan.patch)


def fast_frames(images: list[Image.Image], ip: Any) -> Frames | None:
    """The images as ``Frames`` (bytes, patched where they are used), or ``None`` if not covered."""
    plan = _covered(images, ip)
    if plan is None:
        return None
    raw = np.stack([_frame(_rgb(im, plan), plan) for im in images])  # [N, H, W, C]
    return Frames(torch.from_numpy(raw), plan.table, plan.patch, plan.merge, plan.temporal)


@lru_cache(maxsize=8)
def _byte_table(scale: float, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """float32 ``[C, 256]``: the PIL processor's value of each byte, per channel (read only).

    The PIL processor's arithmetic (rescale in float64, cast to float32, normalise in
    float32) has one result per channel and byte value: the table gives the same floats, bit
    for bit, with one lookup per pixel. Built once per setting: rollouts encode one frame a
    turn.
    """
    levels = (np.arange(256, dtype=np.float64) * scale).astype(np.float32)
    m, sd = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
    return torch.from_numpy((levels[None, :] - m[:, None]) / sd[:, None])


def fast_patches(images: list[Image.Image], ip: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(pixel_values [N * gh * gw, C * T * P * P], image_grid_thw [N, 3])`` or ``None``."""
    frames = fast_frames(images, ip)
    return None if frames is None else (frames.patches(), frames.grid())


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

    def grid(self) -> torch.Tensor:
        """``image_grid_thw [N, 3]`` of these frames."""
        return _grid(len(self), (int(self.data.shape[1]), int(self.data.shape[2])), self.patch)

    def patches(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``pixel_values [N * gh * gw, C * T * P * P]`` float32 on ``device``."""
        shape = (self.patch, self.merge, self.temporal)
        if device is None or torch.device(device).type == "cpu":
            # numpy's strided copy is faster than torch's on a CPU for this layout.
            return torch.from_numpy(_patch_numpy(self.data.numpy(), self.table.numpy(), *shape))
        # Copies that do not wait for the device's queued work (a blocking one would).
        data, table = (t.to(device, non_blocking=True) for t in (self.data, self.table))
        return _patch_torch(data, table, *shape)

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
