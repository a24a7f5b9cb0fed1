"""Build a Qwen2-VL- or Qwen3-VL-architecture policy with random weights, entirely offline.

No model hub is reachable where clew trains, so a policy that is to be trained from
scratch is built here from a config: the real ``Qwen2VLForConditionalGeneration`` code with
a small task tokenizer (``clew.models.tokenizer``) and the torchvision-free processor
(``clew.models.processor``), saved as an ordinary Hugging Face directory. Everything
downstream (training, rollout, serving, ``load_policy``) then handles it exactly like a real
Qwen checkpoint, and a real checkpoint can later replace it without code changes.

Presets (parameter counts measured with the default tokenizer, 402 vocabulary entries;
each extra entry adds ``2 * hidden`` parameters, input and output embeddings, so a full
1024-entry vocabulary gives 1.68M / 7.77M / 149.6M)::

    preset  text: hidden x layers (heads/kv, mlp)  vision: width x depth (heads)  parameters
    tiny    128 x 3  (4/2, 512)                    128 x 1  (4)              1,519,232 (0.68M vision)
    small   256 x 6  (4/2, 1024)                   128 x 4  (4)              7,448,320 (1.34M vision)
    deep    256 x 12 (4/2, 1024)                   128 x 8  (4)             14,146,816 (2.13M vision)
    base    768 x 12 (12/4, 3072)                  512 x 12 (8)            148,662,784 (44.2M vision)

``tiny`` trains on a CPU (tests, the CPU main job); ``small`` learns mazes from pixels on
one GPU (docs/learning-easy.md); ``deep`` is ``small`` with twice the layers, for a policy
that must plan further in one forward pass (the ``easy`` maze's first moves); ``base`` is
for GPU benchmarks (and multi-GPU runs once workers on Ray exist).

``arch="qwen3_vl"`` builds ``Qwen3VLForConditionalGeneration`` from the same presets
(``clew.models.qwen3`` says what differs: a learned, interpolated absolute position
embedding in the vision tower, deepstack taps, Qwen3 attention, interleaved M-RoPE,
patch 16 by default). Its vision tower is larger: one more merger per deepstack tap
(``Preset.vision_deepstack``: tiny (0,), small (1, 3), deep (1, 3, 5), base (3, 7, 11)) and the position
table, ``(image_size / patch_size) ** 2`` entries (Qwen3-VL's 2304 without ``image_size``).
Measured, 402 vocabulary entries, patch 16 and ``image_size=256``: tiny 1,926,976
(1.09M vision), small 8,315,008 (2.21M), deep 15,406,208 (3.39M), base 166,287,104 (61.8M).

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from clew.errors import ConfigError
from clew.models.processor import ClewVLProcessor, make_image_processor
from clew.models.qwen3 import DEFAULT_PATCH_SIZE as QWEN3_PATCH_SIZE
from clew.models.qwen3 import IMAGE_MEAN as QWEN3_IMAGE_MEAN
from clew.models.qwen3 import IMAGE_STD as QWEN3_IMAGE_STD
from clew.models.qwen3 import POSITION_TABLES, build_qwen3_config, init_position_table
from clew.models.text_config import base_text_config
from clew.models.tokenizer import (
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
    build_tokenizer,
)

__all__ = ["ARCHS", "PRESETS", "BuiltModel", "Preset", "build_model", "count_parameters"]

BUILD_INFO_FILE = "clew_build.json"


@dataclass(frozen=True)
class Preset:
    """The sizes of one model preset; ``approx_parameters`` is the measured count (see table)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vision_embed_dim: int
    vision_depth: int
    vision_num_heads: int
    vision_mlp_ratio: int
    approx_parameters: str
    # Qwen3-VL only: vision layers whose features are added after language layers 0, 1, ...
    vision_deepstack: tuple[int, ...] = ()


PRESETS: dict[str, Preset] = {
    "tiny": Preset(128, 3, 4, 2, 512, 128, 1, 4, 4, "1.5M", vision_deepstack=(0,)),
    "small": Preset(256, 6, 4, 2, 1024, 128, 4, 4, 4, "7.5M", vision_deepstack=(1, 3)),
    "deep": Preset(256, 12, 4, 2, 1024, 128, 8, 4, 4, "14.2M", vision_deepstack=(1, 3, 5)),
    "medium": Preset(384, 8, 6, 2, 1536, 128, 4, 4, 4, "19.1M", vision_deepstack=(1, 3)),
    "base": Preset(768, 12, 12, 4, 3072, 512, 12, 8, 4, "149M", vision_deepstack=(3, 7, 11)),
}

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


def mrope_section(head_dim: int) -> list[int]:
    """Split ``head_dim / 2`` rotary frequencies over (time, height, width) as Qwen2-VL does.

    Qwen2-VL uses [16, 24, 24] for head_dim 128, i.e. 1/4, 3/8, 3/8; the model requires the
    sum to be exactly ``head_dim // 2``.
    """
    if head_dim % 2:
        raise ConfigError(f"attention head_dim must be even for rotary embeddings, got {head_dim}")
    half = head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


def _text_config(
    preset: Preset, tokenizer: PreTrainedTokenizerFast, overrides: Mapping[str, Any]
) -> dict[str, Any]:
    config: dict[str, Any] = {**base_text_config(preset, tokenizer), "use_sliding_window": False}
    config.update(overrides)
    if config["hidden_size"] % config["num_attention_heads"]:
        raise ConfigError(
            f"text hidden_size {config['hidden_size']} is not divisible by "
            f"num_attention_heads {config['num_attention_heads']}"
        )
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    config.setdefault(
        "rope_parameters",
        {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": mrope_section(head_dim),
        },
    )
    return config


def _vision_config(
    preset: Preset,
    hidden_size: int,
    patch_size: int,
    merge_size: int,
    temporal_patch_size: int,
    overrides: Mapping[str, Any],
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "depth": preset.vision_depth,
        "embed_dim": preset.vision_embed_dim,
        "num_heads": preset.vision_num_heads,
        "mlp_ratio": preset.vision_mlp_ratio,
        "hidden_act": "quick_gelu",
        "in_channels": 3,
        "patch_size": patch_size,
        "spatial_merge_size": merge_size,
        "temporal_patch_size": temporal_patch_size,
    }
    config.update(overrides)
    # The merger projects vision features straight into the language model's embedding
    # space, so its output width is not a free choice.
    config["hidden_size"] = hidden_size
    if config["embed_dim"] % config["num_heads"]:
        raise ConfigError(
            f"vision embed_dim {config['embed_dim']} is not divisible by num_heads {config['num_heads']}"
        )
    return config


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


def _qwen2_config(
    spec: Preset,
    tokenizer: PreTrainedTokenizerFast,
    geometry: Mapping[str, int],
    text_overrides: Mapping[str, Any],
    vision_overrides: Mapping[str, Any],
) -> Qwen2VLConfig:
    text_config = _text_config(spec, tokenizer, text_overrides)
    vision_config = _vision_config(
        spec,
        text_config["hidden_size"],
        geometry["patch_size"],
        geometry["merge_size"],
        geometry["temporal_patch_size"],
        vision_overrides,
    )
    return Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        video_token_id=tokenizer.convert_tokens_to_ids(VIDEO_TOKEN),
        vision_start_token_id=tokenizer.convert_tokens_to_ids(VISION_START_TOKEN),
        vision_end_token_id=tokenizer.convert_tokens_to_ids(VISION_END_TOKEN),
        tie_word_embeddings=False,
    )


def build_model(
    preset: str,
    output_dir: str | Path,
    corpus: Sequence[str] | None = None,
    *,
    arch: str = "qwen2_vl",
    seed: int = 0,
    image_size: int | None = None,
    patch_size: int | None = None,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    vocab_size: int = 1024,
    dtype: str = "float32",
    text_overrides: Mapping[str, Any] | None = None,
    vision_overrides: Mapping[str, Any] | None = None,
    image_mean: Sequence[float] | None = None,
    image_std: Sequence[float] | None = None,
    position_table: str = "sincos",
    overwrite: bool = False,
) -> BuiltModel:
    """Build a random-weight Qwen-VL policy and save it as a Hugging Face directory.

    ``arch``: "qwen2_vl" (``Qwen2VLForConditionalGeneration``) or "qwen3_vl"
    (``Qwen3VLForConditionalGeneration``, see ``clew.models.qwen3``). ``corpus`` is task
    text for the tokenizer, added to ``default_corpus()``. ``image_size`` (pixels, square
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

    The directory holds config.json, generation_config.json, model.safetensors, the
    tokenizer (tokenizer.json, tokenizer_config.json), chat_template.jinja,
    processor_config.json, preprocessor_config.json and clew_build.json (how it was built).
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; accepted: {', '.join(PRESETS)}")
    if arch not in ARCHS:
        raise ConfigError(f"unknown model arch {arch!r}; accepted: {', '.join(ARCHS)}")
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
    spec = PRESETS[preset]
    output_dir = Path(output_dir)
    _prepare_output_dir(output_dir, overwrite)

    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size)
    geometry = {
        "patch_size": patch_size,
        "merge_size": merge_size,
        "temporal_patch_size": temporal_patch_size,
    }
    model_class: type[PreTrainedModel]
    if arch == "qwen3_vl":
        config = build_qwen3_config(
            spec, tokenizer, geometry, image_size, text_overrides or {}, vision_overrides or {}
        )
        model_class = Qwen3VLForConditionalGeneration
        normalize = {"image_mean": QWEN3_IMAGE_MEAN, "image_std": QWEN3_IMAGE_STD}
    else:
        config = _qwen2_config(
            spec, tokenizer, geometry, text_overrides or {}, vision_overrides or {}
        )
        model_class = Qwen2VLForConditionalGeneration
        normalize = {}
    if image_mean is not None:
        normalize["image_mean"] = list(image_mean)
    if image_std is not None:
        normalize["image_std"] = list(image_std)

    # fork_rng: building a model must not reseed the caller's global generator.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    if arch == "qwen3_vl":
        init_position_table(model, centered=position_table == "centered")
    model = model.to(_DTYPES[dtype])
    model.eval()
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

    model.save_pretrained(output_dir)
    processor.save_pretrained(output_dir)
    # preprocessor_config.json too: the file older loaders and other tools (vLLM, TGI)
    # look for; the composite processor_config.json is transformers 5's.
    image_processor.save_pretrained(output_dir)
    num_parameters = count_parameters(model)
    info = {
        "preset": preset,
        "arch": arch,
        "seed": seed,
        "num_parameters": num_parameters,
        "vocab_size": len(tokenizer),
        "image_size": image_size,
        "patch_size": patch_size,
        "merge_size": merge_size,
        "pixels_per_vision_token": factor,
        "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std),
        "position_table": position_table if arch == "qwen3_vl" else None,
        "dtype": dtype,
        "transformers_version": transformers.__version__,
    }
    (output_dir / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return BuiltModel(
        path=output_dir, model=model, processor=processor, num_parameters=num_parameters
    )
