"""Build a Qwen2-VL- or Qwen3-VL-architecture policy with random weights, entirely offline.

No model hub is reachable where clew trains, so a policy that is to be trained from
scratch is built here from a config: the real ``Qwen2VLForConditionalGeneration`` code with
a small task tokenizer (``clew.models.tokenizer``) and the torchvision-free processor
(``clew.models.processor``), saved as an ordinary Hugging Face directory. Everything
downstream (training, rollout, serving, ``load_policy``) then handles it exactly like a real
Qwen checkpoint, and a real checkpoint can later replace it without code changes.

The presets' sizes and parameter counts are ``clew.models.presets``; ``preset_parameters``
counts one from its config without building it. ``clew.models.qwen2`` and
``clew.models.qwen3`` turn a preset into each architecture's config.

Image geometry (Qwen2-VL's; Qwen3-VL's default patch is 16, so read 16 and 32 px for 14 and
28 there unless ``patch_size=14`` is given): ``patch_size`` (14) and ``spatial_merge_size``
(2) make one language token per ``14 * 2 = 28`` px square, so a maze drawn with 28 px cells
gives one vision token per cell: 252 px (9x9 cells) -> 81 tokens, 140 px (5x5) -> 25 tokens,
each plus the two ``<|vision_start|>``/``<|vision_end|>`` delimiters. The image processor
resizes an image only when its sides are not multiples of 28 (it rounds them) or its pixel
count falls outside ``[min_pixels, max_pixels]``. We set ``min_pixels`` to one merged token
(28 * 28) rather than Qwen's 56 * 56, and ``max_pixels`` to ``image_size ** 2`` when
``image_size`` is given (Qwen's 1280 merged tokens otherwise), so every square maze image
from 28 px up to that size whose side is a multiple of 28 reaches the model pixel for pixel,
and anything larger is scaled down to the token budget rather than lengthening every
sequence. ``merge_size=1`` with ``patch_size`` equal to the cell size gives one vision token
per cell without merging.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from clew.errors import ConfigError
from clew.kernels.fused_norm import fused_rms_norm
from clew.kernels.patch_embed import linear_patch_embed
from clew.models.on_device import instantiate_on_device
from clew.models.presets import PRESETS, QWEN_VOCAB_SIZE, Preset
from clew.models.processor import ClewVLProcessor, make_image_processor
from clew.models.qwen2 import build_qwen2_config, mrope_section
from clew.models.qwen3 import DEFAULT_PATCH_SIZE as QWEN3_PATCH_SIZE
from clew.models.qwen3 import IMAGE_MEAN as QWEN3_IMAGE_MEAN
from clew.models.qwen3 import IMAGE_STD as QWEN3_IMAGE_STD
from clew.models.qwen3 import POSITION_TABLES, build_qwen3_config, init_position_table
from clew.models.sizes import config_parameters
from clew.models.tokenizer import build_tokenizer
from clew.models.vocab import pad_vocabulary

__all__ = [
    "ARCHS",
    "PRESETS",
    "QWEN_VOCAB_SIZE",
    "BuiltModel",
    "Preset",
    "build_model",
    "count_parameters",
    "mrope_section",
    "preset_config",
    "preset_parameters",
]

BUILD_INFO_FILE = "clew_build.json"


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class BuiltModel:
    """What ``build_model`` made: the saved directory and the objects it was saved from."""

    path: Path
    model: PreTrainedModel  # Qwen2VLForConditionalGeneration or Qwen3VLForConditionalGeneration
    processor: ClewVLProcessor
    num_parameters: int
    build_s: float = 0.0  # wall seconds to make the weights (not to save them)
    save_s: float = 0.0


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters in ``model`` (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        if id(parameter) in seen or (trainable_only and not parameter.requires_grad):
            continue
        seen.add(id(parameter))
        total += parameter.numel()
    return total


def _prepare_output_dir(output_dir: Path, overwrite: bool) -> None:
    if output_dir.exists():
        if not output_dir.is_dir():
            raise ConfigError(f"output_dir {output_dir} exists and is not a directory")
        if any(output_dir.iterdir()):
            if not overwrite:
                raise ConfigError(
                    f"output_dir {output_dir} is not empty; pass overwrite=True to replace it "
                    "or choose a new directory"
                )
            shutil.rmtree(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)


ARCHS = ("qwen2_vl", "qwen3_vl")
_DEFAULT_PATCH_SIZE = {"qwen2_vl": 14, "qwen3_vl": QWEN3_PATCH_SIZE}


def _resolve_arch(name: str, spec: Preset, arch: str | None) -> str:
    chosen = arch or spec.arch or "qwen2_vl"
    if chosen not in ARCHS:
        raise ConfigError(f"unknown model arch {chosen!r}; accepted: {', '.join(ARCHS)}")
    if spec.arch is not None and chosen != spec.arch:
        raise ConfigError(
            f"preset {name!r} is {spec.arch}'s architecture; build it with arch {spec.arch!r} "
            f"(or leave arch out), not {chosen!r}"
        )
    return chosen


def _model_config(
    spec: Preset,
    arch: str,
    tokenizer: PreTrainedTokenizerFast,
    geometry: Mapping[str, int],
    image_size: int | None,
    text_overrides: Mapping[str, Any] | None,
    vision_overrides: Mapping[str, Any] | None,
) -> PretrainedConfig:
    text = {**spec.text_fields, **(text_overrides or {})}
    vision = {**spec.vision_fields, **(vision_overrides or {})}
    if arch == "qwen3_vl":
        return build_qwen3_config(spec, tokenizer, geometry, image_size, text, vision)
    return build_qwen2_config(spec, tokenizer, geometry, text, vision)


def preset_config(
    preset: str,
    arch: str | None = None,
    vocab_size: int | None = None,
    text_overrides: Mapping[str, Any] | None = None,
    vision_overrides: Mapping[str, Any] | None = None,
    corpus: Sequence[str] | None = None,
) -> PretrainedConfig:
    """The ``Qwen2VLConfig`` / ``Qwen3VLConfig`` ``build_model`` gives ``preset`` with the
    default geometry, nothing built; ``vocab_size`` pads the vocabulary to that many entries
    (None: the task tokenizer's own, of ``corpus`` as ``build_model`` takes it)."""
    spec = _preset(preset)
    arch = _resolve_arch(preset, spec, arch)
    tokenizer = build_tokenizer(corpus)
    if vocab_size is not None:
        tokenizer = pad_vocabulary(tokenizer, vocab_size)
    geometry = {"patch_size": _DEFAULT_PATCH_SIZE[arch], "merge_size": 2, "temporal_patch_size": 2}
    return _model_config(spec, arch, tokenizer, geometry, None, text_overrides, vision_overrides)


def preset_parameters(
    preset: str,
    arch: str | None = None,
    vocab_size: int | None = None,
    corpus: Sequence[str] | None = None,
) -> int:
    """Parameters of ``preset`` (see ``preset_config``), from its config alone: an 8B count
    without 17 GB of weights."""
    return config_parameters(preset_config(preset, arch, vocab_size, corpus=corpus))


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; accepted: {', '.join(PRESETS)}")
    return PRESETS[name]


def build_model(
    preset: str,
    output_dir: str | Path,
    corpus: Sequence[str] | None = None,
    *,
    arch: str | None = None,
    seed: int = 0,
    image_size: int | None = None,
    patch_size: int | None = None,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    vocab_size: int = 1024,
    padded_vocab_size: int | None = None,
    dtype: str | None = None,
    device: str | None = None,
    text_overrides: Mapping[str, Any] | None = None,
    vision_overrides: Mapping[str, Any] | None = None,
    image_mean: Sequence[float] | None = None,
    image_std: Sequence[float] | None = None,
    position_table: str = "sincos",
    overwrite: bool = False,
) -> BuiltModel:
    """Build a random-weight Qwen-VL policy and save it as a Hugging Face directory.

    ``arch``: "qwen2_vl" (``Qwen2VLForConditionalGeneration``) or "qwen3_vl"
    (``Qwen3VLForConditionalGeneration``, see ``clew.models.qwen3``); None takes the
    preset's own (``qwen3vl-8b``: qwen3_vl), else qwen2_vl. ``corpus`` is task
    text for the tokenizer, added to ``default_corpus()``; ``vocab_size`` caps its BPE, and
    ``padded_vocab_size`` pads it to exactly that many entries with ones no text encodes to
    (``clew.models.vocab``; 151936 is a real Qwen vocabulary). ``image_size`` (pixels, square
    side) caps the image processor at that many pixels and must be a multiple of
    ``patch_size * merge_size`` (see the module docstring); ``patch_size`` defaults to the
    architecture's own (14 for Qwen2-VL, 16 for Qwen3-VL). ``text_overrides`` and
    ``vision_overrides`` replace single fields of the text / vision config
    (``Qwen2VLTextConfig`` / ``Qwen2VLVisionConfig``, or their Qwen3-VL twins, e.g.
    ``num_position_embeddings`` or ``deepstack_visual_indexes``). The same arguments and
    seed give the same weights and tokenizer. ``image_mean`` / ``image_std`` (three values
    each) replace the architecture's pixel normalization, as for a dataset's own statistics.
    ``position_table`` ("sincos" or "centered", Qwen3-VL only) starts the vision position
    table (see ``clew.models.qwen3.init_position_table``).

    ``device`` None builds on the CPU in float32 and casts to ``dtype`` (default float32).
    A device ("cuda", "cuda:1", "cpu") builds there directly (``clew.models.on_device``:
    nothing made on the host, no float32 pass) in ``dtype``, by default bfloat16
    on CUDA and float32 elsewhere; its random draws are that device's, so its weights are
    not the host build's.

    The directory holds config.json, generation_config.json, model.safetensors, the
    tokenizer (tokenizer.json, tokenizer_config.json), chat_template.jinja,
    processor_config.json, preprocessor_config.json and clew_build.json (how it was built).
    """
    spec = _preset(preset)
    arch = _resolve_arch(preset, spec, arch)
    if dtype is None:
        dtype = "bfloat16" if device is not None and device.startswith("cuda") else "float32"
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; accepted: {', '.join(_DTYPES)}")
    if image_mean is not None and len(image_mean) != 3:
        raise ConfigError(f"image_mean takes three values (R, G, B), got {list(image_mean)}")
    if image_std is not None and (len(image_std) != 3 or min(image_std) <= 0):
        raise ConfigError(
            f"image_std takes three values (R, G, B), each > 0, got {list(image_std)}"
        )
    if position_table not in POSITION_TABLES:
        raise ConfigError(
            f"unknown position_table {position_table!r}; accepted: {', '.join(POSITION_TABLES)}"
        )
    if position_table != "sincos" and arch != "qwen3_vl":
        raise ConfigError(
            f"position_table {position_table!r} needs arch qwen3_vl ({arch} has no position table)"
        )
    if patch_size is None:
        patch_size = _DEFAULT_PATCH_SIZE[arch]
    if patch_size < 1 or merge_size < 1:
        raise ConfigError(f"patch_size and merge_size must be >= 1, got {patch_size}, {merge_size}")
    factor = patch_size * merge_size
    if image_size is not None and (image_size < factor or image_size % factor):
        raise ConfigError(
            f"image_size {image_size} is not a positive multiple of patch_size * merge_size = "
            f"{factor}; the processor would resize such images. Use e.g. "
            f"{max(factor, image_size // factor * factor)} or {(image_size // factor + 1) * factor}"
        )
    target = None if device is None else _device(device)
    output_dir = Path(output_dir)
    _prepare_output_dir(output_dir, overwrite)

    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size)
    if padded_vocab_size is not None:
        tokenizer = pad_vocabulary(tokenizer, padded_vocab_size)
    geometry = {
        "patch_size": patch_size,
        "merge_size": merge_size,
        "temporal_patch_size": temporal_patch_size,
    }
    config = _model_config(
        spec, arch, tokenizer, geometry, image_size, text_overrides, vision_overrides
    )
    model_class: type[PreTrainedModel]
    if arch == "qwen3_vl":
        model_class = Qwen3VLForConditionalGeneration
        normalize = {"image_mean": QWEN3_IMAGE_MEAN, "image_std": QWEN3_IMAGE_STD}
    else:
        model_class = Qwen2VLForConditionalGeneration
        normalize = {}
    if image_mean is not None:
        normalize["image_mean"] = list(image_mean)
    if image_std is not None:
        normalize["image_std"] = list(image_std)

    started = time.perf_counter()
    if target is None:
        # fork_rng: building a model must not reseed the caller's global generator.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_class(config)
    else:
        model = instantiate_on_device(model_class, config, target, _DTYPES[dtype], seed)
    if arch == "qwen3_vl":
        init_position_table(model, centered=position_table == "centered")
    if target is None:
        model = model.to(_DTYPES[dtype])
    model.eval()
    if target is not None and target.type == "cuda":
        torch.cuda.synchronize(target)
    build_s = time.perf_counter() - started
    # Stop on <|im_end|> (end of turn) or <|endoftext|>; greedy unless the caller samples.
    text = config.text_config
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=[text.eos_token_id, text.pad_token_id],
        pad_token_id=text.pad_token_id,
        do_sample=False,
    )

    image_processor = make_image_processor(
        patch_size=patch_size,
        merge_size=merge_size,
        temporal_patch_size=temporal_patch_size,
        max_pixels=None if image_size is None else image_size * image_size,
        **normalize,
    )
    processor = ClewVLProcessor(image_processor, tokenizer, chat_template=tokenizer.chat_template)

    started = time.perf_counter()
    model.save_pretrained(output_dir)
    processor.save_pretrained(output_dir)
    # preprocessor_config.json too: the file older loaders and other tools (vLLM, TGI)
    # look for; the composite processor_config.json is transformers 5's.
    image_processor.save_pretrained(output_dir)
    save_s = time.perf_counter() - started
    num_parameters = count_parameters(model)
    info = {
        "preset": preset,
        "arch": arch,
        "seed": seed,
        "num_parameters": num_parameters,
        "vocab_size": len(tokenizer),
        "padded_vocab": padded_vocab_size is not None,
        "image_size": image_size,
        "patch_size": patch_size,
        "merge_size": merge_size,
        "pixels_per_vision_token": factor,
        "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std),
        "position_table": position_table if arch == "qwen3_vl" else None,
        "dtype": dtype,
        "device": None if target is None else str(target),
        "transformers_version": transformers.__version__,
    }
    (output_dir / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    linear_patch_embed(model)  # computing as the loaded policy does (load_policy)
    fused_rms_norm(model)
    return BuiltModel(output_dir, model, processor, num_parameters, build_s, save_s)


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {name!r}; accepted: cpu, cuda, cuda:N") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but this machine has no CUDA device")
    return device
