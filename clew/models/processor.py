"""A Qwen2-VL processor that works without torchvision.

transformers' ``Qwen2VLProcessor`` declares a video processor, and the video processor
classes need torchvision. Without it (clew does not install torchvision beside its CPU
torch) both ``Qwen2VLProcessor(...)`` and ``AutoProcessor.from_pretrained``
fail inside transformers with ``VIDEO_PROCESSOR_MAPPING has no attribute '_extra_content'``,
even when no video processor is passed. clew's agents only ever send images, so this
subclass declares just an image processor and a tokenizer; everything else (image
placeholder expansion, ``mm_token_type_ids``, chat templates, save and load) is inherited
from ``Qwen2VLProcessor`` unchanged.

It serves Qwen3-VL directories too: ``Qwen3VLProcessor`` expands ``<|image_pad|>`` exactly
as ``Qwen2VLProcessor`` does (``grid_thw.prod() // merge_size**2`` tokens per image) and
differs only for videos (per-frame timestamps), and Qwen3-VL checkpoints use the same
Qwen2-VL image processor class (patch 16, mean and std 0.5 in their config).

The image processor is the PIL one (``Qwen2VLImageProcessorPil``), which needs no
torchvision, on every machine: ``from_pretrained`` swaps in the PIL twin where torchvision
would have been picked, so pixel values are identical everywhere. A directory saved from this class records ``processor_class:
ClewVLProcessor``. ``AutoProcessor`` resolves processor names it does not ship by looking
through the classes registered with ``AutoProcessor.register``, so importing this module
registers ``ClewVLProcessor`` under a private config key (one no real config ever has, so
no real model's processor changes). After ``import clew.models``,
``AutoProcessor.from_pretrained`` reads such a directory back; in a process that has not
imported clew it falls back to ``Qwen2VLProcessor``, which needs torchvision.
``ClewVLProcessor.from_pretrained`` always works.

Written against transformers 5.17 (the oldest supported) and checked on 5.24.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from transformers import AutoProcessor, PreTrainedConfig, Qwen2VLImageProcessorPil, Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

__all__ = ["ClewVLProcessor", "image_processor_kwargs", "make_image_processor"]

_IMAGE_TOKEN = "<|image_pad|>"
_VIDEO_TOKEN = "<|video_pad|>"
_TORCHVISION_IMAGE_PROCESSORS = frozenset({"Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast"})
_HUB_KWARGS = ("cache_dir", "local_files_only", "revision", "subfolder", "token")


class ClewVLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with an image processor and a tokenizer, and no video processor.

    ``ProcessorMixin`` discovers a processor's parts from the parameter names of
    ``__init__``, so the signature below (no ``video_processor``) is what removes the video
    processor; do not add one back.
    """

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        # Mirrors Qwen2VLProcessor.__init__ minus the video processor; calling it would pass
        # video_processor positionally to ProcessorMixin.
        self.image_token = getattr(tokenizer, "image_token", None) or _IMAGE_TOKEN
        self.video_token = getattr(tokenizer, "video_token", None) or _VIDEO_TOKEN
        self.image_token_id = getattr(
            tokenizer, "image_token_id", None
        ) or tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = getattr(
            tokenizer, "video_token_id", None
        ) or tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike[str], **kwargs: Any
    ) -> ClewVLProcessor:
        """Load as ``ProcessorMixin.from_pretrained`` does, then pin the PIL image processor.

        Where torchvision is installed, ``AutoImageProcessor`` picks
        the torchvision ``Qwen2VLImageProcessor``, whose pixel values differ from the PIL
        one's in the last float bits; a policy must see the same pixels on every machine
        it is trained, rolled out and served on, so the PIL twin is loaded instead.
        """
        processor = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        if type(processor.image_processor).__name__ in _TORCHVISION_IMAGE_PROCESSORS:
            hub_kwargs = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
            processor.image_processor = Qwen2VLImageProcessorPil.from_pretrained(
                pretrained_model_name_or_path, **hub_kwargs
            )
        return processor


def image_processor_kwargs(
    *,
    patch_size: int = 14,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    image_mean: Sequence[float] | None = None,
    image_std: Sequence[float] | None = None,
) -> dict[str, Any]:
    """The settings of a Qwen2-VL image processor (PIL or torchvision-backed alike) with the
    given patch geometry and pixel budget.

    The processor resizes every image to a multiple of ``patch_size * merge_size`` with its
    pixel count inside ``[min_pixels, max_pixels]``; images already a multiple and inside
    the range pass through unresized. Defaults: ``min_pixels`` one merged token
    (``factor**2``), ``max_pixels`` ``factor**2 * 1280`` (Qwen2-VL's own cap of 1280 merged
    tokens). ``image_mean`` / ``image_std``: per-channel normalization, CLIP's (Qwen2-VL's)
    unless given; Qwen3-VL uses 0.5 / 0.5. Qwen3-VL checkpoints use this same image processor
    class, so it serves both architectures.
    """
    factor = patch_size * merge_size
    kwargs: dict[str, Any] = {
        "patch_size": patch_size,
        "merge_size": merge_size,
        "temporal_patch_size": temporal_patch_size,
        "min_pixels": factor * factor if min_pixels is None else min_pixels,
        "max_pixels": factor * factor * 1280 if max_pixels is None else max_pixels,
    }
    if image_mean is not None:
        kwargs["image_mean"] = list(image_mean)
    if image_std is not None:
        kwargs["image_std"] = list(image_std)
    return kwargs


def make_image_processor(**settings: Any) -> Qwen2VLImageProcessorPil:
    """A PIL Qwen2-VL image processor with ``image_processor_kwargs(**settings)``."""
    return Qwen2VLImageProcessorPil(**image_processor_kwargs(**settings))


class _ClewVLProcessorKey(PreTrainedConfig):
    """A config type no checkpoint uses: the key under which ClewVLProcessor is registered.

    Registering under Qwen2VLConfig instead would swap the processor of every real Qwen2-VL
    checkpoint loaded in this process.
    """

    model_type = "clew_vl_processor_key"


def _register_with_auto_processor() -> None:
    # Should a future transformers change this API, only AutoProcessor's name lookup is
    # lost; ClewVLProcessor.from_pretrained and load_policy keep working.
    with contextlib.suppress(TypeError, ValueError):
        AutoProcessor.register(_ClewVLProcessorKey, ClewVLProcessor, exist_ok=True)


_register_with_auto_processor()
