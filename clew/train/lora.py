"""LoRA adapters on the language model of a Qwen-VL policy (peft).

Why the language model only, by default: the maze policy's job is to turn what the vision
tower already sees into moves, and adapting the vision tower too multiplies the adapter
without helping that; peft's own ``all-linear`` would also wrap the vision blocks and the
patch merger. So clew's ``all-linear`` (the config default) means every attention and MLP
projection of the decoder layers under ``model.language_model``, written as a peft regex
(peft full-matches a string ``target_modules`` against module names). A list of names is
passed to peft unchanged, for anyone who wants different modules.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from clew.errors import ConfigError

LANGUAGE_MODEL_TARGETS = (
    r"(.*\.)?language_model\.layers\.\d+\."
    r"(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"
)


def lora_targets(target_modules: str | list[str] | None) -> str | list[str]:
    """peft's ``target_modules`` for clew's setting ("all-linear"/None: the language model)."""
    if target_modules is None or target_modules in ("all-linear", "language_model"):
        return LANGUAGE_MODEL_TARGETS
    return target_modules


def apply_lora(
    model: torch.nn.Module,
    rank: int,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target_modules: str | list[str] | None = "all-linear",
) -> PeftModel:
    """``model`` wrapped with LoRA adapters; only the adapter weights stay trainable."""
    if rank <= 0:
        raise ConfigError(f"LoRA rank must be positive to add adapters, got {rank}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"LoRA dropout must be in [0, 1), got {dropout}")
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=lora_targets(target_modules),
        bias="none",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # peft: "Target modules ... not found in the base model"
        raise ConfigError(f"could not add LoRA adapters: {error}") from None


def is_lora(model: torch.nn.Module) -> bool:
    return isinstance(model, PeftModel)
