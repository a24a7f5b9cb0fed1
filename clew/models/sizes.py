"""Parameter counts of Qwen2-VL and Qwen3-VL configs by arithmetic, without building a model.

An 8B policy takes 16 GB in bfloat16 and minutes to build on a CPU, so the preset table's
counts are derived here from the config fields and the layer shapes of transformers'
``modeling_qwen2_vl`` / ``modeling_qwen3_vl`` (a test holds them equal to built models).
"""

from __future__ import annotations

from typing import Any

__all__ = ["config_parameters", "text_parameters", "vision_parameters"]


def _linear(inputs: int, outputs: int, bias: bool) -> int:
    return inputs * outputs + (outputs if bias else 0)


def text_parameters(text: Any, qwen3: bool, tied: bool = False) -> int:
    """The language model's parameters: embeddings, decoder layers, final norm and, unless
    ``tied``, the output projection. ``text`` is a ``Qwen2VLTextConfig`` or ``Qwen3VLTextConfig``."""
    hidden, heads, kv = text.hidden_size, text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    if qwen3:
        bias = bool(text.attention_bias)
        attention = (
            _linear(hidden, heads * head_dim, bias)
            + 2 * _linear(hidden, kv * head_dim, bias)
            + _linear(heads * head_dim, hidden, bias)
            + 2 * head_dim  # q_norm and k_norm over the head dimension
        )
    else:  # Qwen2: biases on q, k and v, none on o
        attention = (
            _linear(hidden, heads * head_dim, True)
            + 2 * _linear(hidden, kv * head_dim, True)
            + _linear(heads * head_dim, hidden, False)
        )
    mlp = 3 * hidden * text.intermediate_size  # gate, up, down; no biases
    layer = attention + mlp + 2 * hidden  # input and post-attention RMSNorms
    embeddings = text.vocab_size * hidden
    head = 0 if tied else text.vocab_size * hidden
    return embeddings + text.num_hidden_layers * layer + hidden + head


def vision_parameters(vision: Any, qwen3: bool) -> int:
    """The vision tower's parameters (patch embedding, blocks, merger, and for Qwen3-VL the
    position table and deepstack mergers). ``vision`` is a ``Qwen2VLVisionConfig`` or
    ``Qwen3VLVisionConfig``."""
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    merge = vision.spatial_merge_size**2
    if qwen3:
        width, mlp_width, out = vision.hidden_size, vision.intermediate_size, vision.out_hidden_size
    else:
        width, mlp_width = vision.embed_dim, vision.embed_dim * vision.mlp_ratio
        out = vision.hidden_size
    block = (
        4 * width  # two LayerNorms, weight and bias
        + _linear(width, 3 * width, True)
        + _linear(width, width, True)
        + _linear(width, mlp_width, True)
        + _linear(mlp_width, width, True)
    )
    merged = width * merge

    def merger(norm_width: int) -> int:
        return 2 * norm_width + _linear(merged, merged, True) + _linear(merged, out, True)

    total = patch * width + vision.depth * block + merger(width)
    if qwen3:
        total += width  # the patch embedding's bias
        total += vision.num_position_embeddings * width
        # Deepstack mergers norm after the 2x2 shuffle, over the merged width.
        total += len(vision.deepstack_visual_indexes) * merger(merged)
    return total


def config_parameters(config: Any) -> int:
    """Parameters of the model ``config`` (a ``Qwen2VLConfig`` or ``Qwen3VLConfig``) builds,
    tied weights counted once."""
    qwen3 = config.model_type == "qwen3_vl"
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return text_parameters(config.text_config, qwen3, tied) + vision_parameters(
        config.vision_config, qwen3
    )
