"""The language-model config fields every clew-built Qwen-VL shares, whatever its generation."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerFast

from clew.models.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN


def base_text_config(preset: Any, tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    """Sizes from ``preset``, vocabulary and special ids from ``tokenizer``."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "bos_token_id": tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        "eos_token_id": tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    }
