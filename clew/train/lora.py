"""LoRA adapters on the language model of a Qwen-VL policy (peft).

Why the language model only, by default: the maze policy's job is to turn what the vision
tower already sees into moves, and adapting the vision tower too multiplies the adapter
without helping that; peft's own ``all-linear`` would also wrap the vision blocks and the
patch merger. So clew's ``all-linear`` (the config default) means every attention and MLP
projection of the decoder layers under ``model.language_model``, written as a peft regex
(peft full-matches a string ``target_modules`` against module names). A list of names is
passed to peft unchanged, for anyone who wants different modules.

Rollouts sample from the adapter merged into its base (``merged_for_rollouts``): an
unmerged LoRA layer runs three matmuls where a merged one runs one, and a small policy's
decode step is bound by kernel launches, so the unmerged adapter made the GRPO generate
phase 1.5x slower on the H200 (3.8 s against 5.7 s a step, BENCHMARKS.md "Twelfth
attempt"; ``benchmarks/lora_rollout.py`` measures it). peft's ``merge_adapter`` /
``unmerge_adapter`` do the arithmetic; the merge is used only over float32 base weights,
where adding and then subtracting the adapter's delta gives the weights back to float
rounding (about 1e-7 of each weight). Over bfloat16 weights a delta below a weight's
rounding step would vanish from the merged copy (an early adapter would not be sampled
at all), so there the rollout runs the adapter unmerged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


def mergeable(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a LoRA model whose adapted base weights are all float32."""
    if not is_lora(model):
        return False
    bases = [m.get_base_layer().weight for m in model.modules() if hasattr(m, "lora_A")]
    return bool(bases) and all(w.dtype == torch.float32 for w in bases)


@contextlib.contextmanager
def merged_for_rollouts(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` with its adapter merged into the base weights, unmerged on the way out.

    A no-op for a model without LoRA or with low-precision base weights (module docstring).
    Sampling only: the merged layers carry no gradient to the adapter.
    """
    if not mergeable(model):
        yield model
        return
    with torch.no_grad():
        model.merge_adapter()
    try:
        yield model
    finally:
        with torch.no_grad():
            model.unmerge_adapter()
