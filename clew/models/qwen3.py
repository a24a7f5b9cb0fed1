"""The Qwen3-VL half of ``clew.models.factory``: configs for ``arch="qwen3_vl"``.

What Qwen3-VL changes against Qwen2-VL, as far as a small policy built from scratch sees:

- Vision: a learned absolute position embedding (``pos_embed``, a square table of
  ``num_position_embeddings`` entries, bilinearly resampled to each image's patch grid) on
  top of the 2D rotary embedding; Qwen2-VL's tower has only the rotary one. Default patch
  size 16 (Qwen2-VL: 14); GELU (tanh) MLPs; the merger writes ``out_hidden_size``.
  ``deepstack_visual_indexes`` taps intermediate vision layers: the features of the i-th
  listed layer pass their own merger and are added to the hidden states at the image
  tokens after language layer i (so the list must be no longer than the language model).
  clew starts that table as a 2D sin-cos grid (``init_position_table``), not at random.
- Language: Qwen3 attention (RMS-normed queries and keys, no qkv bias, an explicit
  ``head_dim``) and *interleaved* M-RoPE: the rotary frequencies cycle t, h, w rather than
  coming in three blocks. ``mrope_section`` still sums to ``head_dim / 2``; Qwen3-VL uses
  [24, 20, 20] for head_dim 128.
- Positions: for images exactly Qwen2-VL's (t = h = w = start for the first token of an
  image, the text after it at ``start + max(h, w)``), so ``clew.models.positions``
  serves both; Qwen3-VL differs only for videos (per-frame timestamps), which clew never
  sends.

Sizes come from the same ``Preset`` table as Qwen2-VL: vision ``hidden_size`` is the
preset's vision width, ``intermediate_size`` width x mlp ratio; ``vision_deepstack`` gives
the deepstack taps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerFast, Qwen3VLConfig

from clew.errors import ConfigError
from clew.models.text_config import base_text_config
from clew.models.tokenizer import (
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
)

if TYPE_CHECKING:
    from clew.models.factory import Preset

__all__ = ["DEFAULT_PATCH_SIZE", "build_qwen3_config", "qwen3_mrope_section"]

DEFAULT_PATCH_SIZE = 16
# Qwen3-VL's own table: 48 x 48 positions (768 px at patch 16), used when no image_size.
DEFAULT_NUM_POSITION_EMBEDDINGS = 2304
# Qwen3-VL's image processor normalizes to [-1, 1] (Qwen2-VL uses CLIP's mean and std).
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)


def qwen3_mrope_section(head_dim: int) -> list[int]:
    """Split ``head_dim / 2`` frequencies over (t, h, w) in Qwen3-VL's [24, 20, 20] ratio.

    Interleaved M-RoPE gives h the frequencies 1, 4, 7, ... below ``3 * section[1]`` and w
    2, 5, 8, ... below ``3 * section[2]``; t keeps the rest. The split below keeps
    ``3 * section[i] <= head_dim / 2``, so the sections count exactly what each axis gets.
    """
    if head_dim % 2:
        raise ConfigError(f"attention head_dim must be even for rotary embeddings, got {head_dim}")
    half = head_dim // 2
    spatial = half * 5 // 16
    return [half - 2 * spatial, spatial, spatial]


def _text_config(
    preset: Preset, tokenizer: PreTrainedTokenizerFast, overrides: Mapping[str, Any]
) -> dict[str, Any]:
    config: dict[str, Any] = {**base_text_config(preset, tokenizer), "attention_bias": False}
    config.update(overrides)
    if "head_dim" not in config:
        # Qwen3VLTextConfig defaults head_dim to 128 whatever the width; derive it instead.
        if config["hidden_size"] % config["num_attention_heads"]:
            raise ConfigError(
                f"text hidden_size {config['hidden_size']} is not divisible by "
                f"num_attention_heads {config['num_attention_heads']}; set head_dim explicitly"
            )
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    config.setdefault(
        "rope_parameters",
        {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": qwen3_mrope_section(config["head_dim"]),
            "mrope_interleaved": True,
        },
    )
    section = config["rope_parameters"].get("mrope_section")
    if section is not None and sum(section) != config["head_dim"] // 2:
        raise ConfigError(
            f"mrope_section {section} must sum to head_dim / 2 = {config['head_dim'] // 2}"
        )
    return config


def _vision_config(
    preset: Preset,
    out_hidden_size: int,
    num_text_layers: int,
    geometry: Mapping[str, int],
    image_size: int | None,
    overrides: Mapping[str, Any],
) -> dict[str, Any]:
    patch_size = geometry["patch_size"]
    config: dict[str, Any] = {
        "depth": preset.vision_depth,
        "hidden_size": preset.vision_embed_dim,
        "intermediate_size": preset.vision_embed_dim * preset.vision_mlp_ratio,
        "num_heads": preset.vision_num_heads,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": patch_size,
        "spatial_merge_size": geometry["merge_size"],
        "temporal_patch_size": geometry["temporal_patch_size"],
        # One learned position per patch of the largest image: exact at that size (bilinear
        # resampling with align_corners is the identity there), interpolated below it.
        "num_position_embeddings": (
            DEFAULT_NUM_POSITION_EMBEDDINGS
            if image_size is None
            else (image_size // patch_size) ** 2
        ),
        "deepstack_visual_indexes": list(preset.vision_deepstack),
    }
    config.update(overrides)
    # The mergers project vision features straight into the language model's embedding
    # space, so their output width is not a free choice.
    config["out_hidden_size"] = out_hidden_size
    if config["hidden_size"] % config["num_heads"]:
        raise ConfigError(
            f"vision hidden_size {config['hidden_size']} is not divisible by num_heads "
            f"{config['num_heads']}"
        )
    side = round(config["num_position_embeddings"] ** 0.5)
    if side < 1 or side * side != config["num_position_embeddings"]:
        raise ConfigError(
            f"num_position_embeddings must be a square number (a side x side table), got "
            f"{config['num_position_embeddings']}"
        )
    taps = list(config["deepstack_visual_indexes"])
    if any(not 0 <= i < config["depth"] for i in taps) or len(set(taps)) != len(taps):
        raise ConfigError(
            f"deepstack_visual_indexes {taps} must be distinct vision layers in "
            f"[0, {config['depth']})"
        )
    if len(taps) > num_text_layers:
        raise ConfigError(
            f"{len(taps)} deepstack taps feed language layers 0..{len(taps) - 1}, but the "
            f"language model has {num_text_layers} layers"
        )
    config["deepstack_visual_indexes"] = taps
    return config


def build_qwen3_config(
    preset: Preset,
    tokenizer: PreTrainedTokenizerFast,
    geometry: Mapping[str, int],
    image_size: int | None,
    text_overrides: Mapping[str, Any],
    vision_overrides: Mapping[str, Any],
) -> Qwen3VLConfig:
    """The ``Qwen3VLConfig`` of a preset.

    ``geometry`` holds patch_size, merge_size and temporal_patch_size.
    """
    text = _text_config(preset, tokenizer, text_overrides)
    vision = _vision_config(
        preset,
        text["hidden_size"],
        text["num_hidden_layers"],
        geometry,
        image_size,
        vision_overrides,
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        video_token_id=tokenizer.convert_tokens_to_ids(VIDEO_TOKEN),
        vision_start_token_id=tokenizer.convert_tokens_to_ids(VISION_START_TOKEN),
        vision_end_token_id=tokenizer.convert_tokens_to_ids(VISION_END_TOKEN),
        tie_word_embeddings=False,
    )


def sincos_position_table(side: int, width: int) -> torch.Tensor:
    """A ``[side * side, width]`` 2D sin-cos table (MAE's fixed ViT embedding), row-major.

    Half the channels encode the row, half the column, each as sines and cosines over
    geometric frequencies. The lowest frequencies are nearly linear in the coordinate, so
    "left of" or "above" is a linear read-out from the first layer on.
    """
    if width % 4:
        raise ConfigError(f"a 2D sin-cos table needs a width divisible by 4, got {width}")
    quarter = width // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    coords = torch.arange(side, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")

    def encode(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.reshape(-1, 1) * omega[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([encode(rows), encode(cols)], dim=1).float()


POSITION_TABLES = ("sincos", "centered")
# The centered table's scale: the plain table's rms is 0.71, a white or gray maze cell's patch
# embedding about 0.25-0.5; at 0.3x the two are of a size, so neither drowns the other.
CENTERED_SCALE = 0.3


def init_position_table(model: torch.nn.Module, *, centered: bool = False) -> None:
    """Start Qwen3-VL's learned vision position table as a 2D sin-cos grid (still learned).

    transformers initialises it at random, which is right for a checkpoint that will be
    overwritten by pretrained weights; a policy trained from scratch otherwise has to learn
    from reward or imitation alone which patch is where, which is most of what a maze asks.

    ``centered``: the table less its mean over positions, scaled by ``CENTERED_SCALE``. The
    low-frequency cosines are near 1 at every position, so the plain table adds one vector
    to every patch: measured on untrained `small` policies over maze frames, 80% of the
    image embeddings' energy reaching the language model was that shared vector and 3%
    varied with the frame; the language model then sees nearly one input whatever the maze.
    """
    embed = model.model.visual.pos_embed
    side = round(embed.num_embeddings**0.5)
    table = sincos_position_table(side, embed.embedding_dim)
    if centered:
        table = (table - table.mean(0, keepdim=True)) * CENTERED_SCALE
    with torch.no_grad():
        embed.weight.copy_(table)
