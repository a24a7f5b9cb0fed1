"""What transformers' torchvision-backed Qwen-VL image processor does to a frame, without torchvision.

Where torchvision is installed, ``AutoImageProcessor`` and
``Qwen2VLImageProcessor(...)`` give the torchvision-backed class (transformers 5:
``TorchvisionBackend``; checkpoints that name the older ``Qwen2VLImageProcessorFast`` get it
too), and Qwen2.5-VL, Qwen3-VL and Qwen3.5 checkpoints use that same class. Called frame by
frame it was measured many times slower than ``clew.models.pixels``' vectorised path.
Its arithmetic differs from its PIL twin's in two places, so the PIL twin's values are not
its values:

- Resize: ``torchvision.transforms.v2.functional.resize`` on the stacked uint8
  ``[N, C, H, W]`` tensor (``resize_image``), which calls ``torch.nn.functional.interpolate``
  (antialiased for bilinear and bicubic, ``align_corners=False``). On a CPU it interpolates
  the uint8 tensor itself for bicubic, and for bilinear where the CPU has AVX2 or AVX-512;
  otherwise it interpolates in float32, clamps to [0, 255] (bicubic), rounds and casts back
  to uint8. Pillow's resize gives other bytes.
- Rescale and normalise, fused: ``(x - mean / scale) / (std / scale)`` in float32
  (``rescale_and_normalize``), where the PIL processor computes ``(x * scale - mean) / std``:
  the last bits differ.

``resize`` calls ``interpolate`` both ways torchvision may (``RESIZES``); which of them the
processor took on this machine and torchvision version is settled by ``clew.models.pixels``
on a probe image, once per processor and frame size. ``byte_table`` runs the processor's own
``rescale_and_normalize`` over the 256 byte values, so the table holds its values bit for bit
whatever its transformers version computes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "RESIZES",
    "byte_table",
    "interpolation",
    "is_torchvision_processor",
    "resize",
]

RESIZES = ("uint8", "float32")
"""How torchvision may resize a uint8 image: interpolating the bytes themselves, or in float32
then rounding back to bytes."""

# PIL resample filters as transformers maps them onto torchvision's modes
# (``pil_torch_interpolation_mapping``), for those ``interpolate`` has: NEAREST is
# NEAREST_EXACT there. BOX, HAMMING and LANCZOS have no ``interpolate`` mode.
_MODES = {0: "nearest-exact", 2: "bilinear", 3: "bicubic"}
_TORCHVISION_BASES = frozenset({"TorchvisionBackend", "BaseImageProcessorFast"})


def is_torchvision_processor(ip: Any) -> bool:
    """Whether ``ip`` is a torchvision-backed transformers image processor.

    transformers 5 names the backend (``ip.backend``); the base class names cover a class that
    does not. Recognised by backend, not by model: every Qwen-VL generation's processor
    (``Qwen2VLImageProcessor``, also Qwen2.5-VL's, Qwen3-VL's and Qwen3.5's) is one class.
    """
    try:
        if getattr(ip, "backend", None) == "torchvision":
            return True
    except Exception:  # noqa: BLE001 - a property that fails names no backend
        pass
    return any(cls.__name__ in _TORCHVISION_BASES for cls in type(ip).__mro__)


def interpolation(resample: Any) -> str | None:
    """The ``interpolate`` mode of a processor's ``resample`` (a PIL filter or torchvision's
    ``InterpolationMode``), or ``None`` where ``interpolate`` has none."""
    value = getattr(resample, "value", resample)
    if isinstance(value, str):
        return value if value in _MODES.values() else None
    try:
        return _MODES.get(int(value))
    except (TypeError, ValueError):
        return None


def resize(frame: np.ndarray, size: tuple[int, int], mode: str, how: str) -> np.ndarray:
    """uint8 ``[H, W, C]`` ``frame`` at ``size`` (height, width), as torchvision's
    ``resize_image`` computes it ``how`` (one of ``RESIZES``)."""
    # [1, C, H, W] contiguous, as the processor stacks its CHW frames (a copy: writable).
    x = torch.from_numpy(np.array(frame.transpose(2, 0, 1), order="C"))[None]
    smooth = mode in ("bilinear", "bicubic")
    kwargs: dict[str, Any] = {"align_corners": False, "antialias": True} if smooth else {}
    if how == "uint8":
        out = F.interpolate(x, size=list(size), mode=mode, **kwargs)
    else:
        out = F.interpolate(x.to(torch.float32), size=list(size), mode=mode, **kwargs)
        if mode == "bicubic":
            out = out.clamp_(min=0, max=255)
        out = out.round_().to(torch.uint8)
    return out[0].permute(1, 2, 0).contiguous().numpy()


def byte_table(ip: Any, channels: int) -> torch.Tensor | None:
    """float32 ``[C, 256]``: ``ip``'s value of each byte per channel, by its own
    ``rescale_and_normalize`` with its own settings (elementwise, so a value depends only on
    its byte and channel), or ``None`` where the processor has no such method."""
    ramp = torch.arange(256, dtype=torch.uint8).repeat(channels, 1)[None, :, None, :]
    try:
        # The arguments as the processor's preprocess passes them (means and stds as tuples).
        mean, std = tuple(ip.image_mean), tuple(ip.image_std)
        out = ip.rescale_and_normalize(ramp.contiguous(), True, ip.rescale_factor, True, mean, std)
    except Exception:  # noqa: BLE001 - another signature: not covered, the processor runs
        return None
    if not isinstance(out, torch.Tensor) or out.shape != ramp.shape:
        return None
    return out.to(torch.float32).reshape(channels, 256).contiguous()
