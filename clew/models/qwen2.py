"""The Qwen2-VL half of ``clew.models.factory``: configs for ``arch="qwen2_vl"``.

Sizes come from the ``Preset`` table (``clew.models.presets``): the vision tower's
``embed_dim`` is the preset's vision width and its MLP ``mlp_ratio`` times that; the merger
writes the language model's width.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerFast, Qwen2VLConfig

from clew.errors import ConfigError
from clew.models.presets import Preset
from clew.models.text_config import base_text_config
from clew.models.tokenizer import (
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
)

__all__ = ["build_qwen2_config", "mrope_section"]


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


def build_qwen2_config(
    spec: Preset,
    tokenizer: PreTrainedTokenizerFast,
    geometry: Mapping[str, int],
    text_overrides: Mapping[str, Any],
    vision_overrides: Mapping[str, Any],
) -> Qwen2VLConfig:
    """The ``Qwen2VLConfig`` of a preset; ``geometry`` holds patch_size, merge_size and
    temporal_patch_size."""
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
