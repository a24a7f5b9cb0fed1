"""LoRA adapters on the language model of a Qwen-VL policy (peft).

Why the language model only, by default: the maze policy's job is to turn what the vision
tower already sees into moves, and adapting the vision tower too multiplies the adapter
without helping that; peft's own ``all-linear`` would also wrap the vision blocks and the
patch merger. So clew's ``all-linear`` (the config default) means every attention and MLP
projection of the decoder layers under ``model.language_model``, written as a peft regex
(peft full-matches a string ``target_modules`` against module names). ``vision_and_language``
is peft's ``all-linear``: the vision blocks and mergers too, for a policy whose frame
reading itself must change (language-model adapters leave a maze policy's junction choices
about where SFT put them). Any other string is a peft regex, and a list
of names is passed to peft unchanged, for anyone who wants different modules.

Rollouts sample from the adapter merged into its base (``merged_for_rollouts``): an
unmerged LoRA layer runs three matmuls where a merged one runs one, and a small policy's
decode step is bound by kernel launches, so with the adapter unmerged the GRPO generate
phase was measured much slower than with full weights (BENCHMARKS.md, LoRA rollouts;
``benchmarks/lora_rollout.py`` compares the two in one run). peft's
``merge_adapter`` / ``unmerge_adapter`` do the arithmetic. Over float32 base weights adding
and then subtracting the delta gives the weights back to float rounding (about 1e-7 of
each). Over bfloat16 ones (the frozen base of a LoRA run on a GPU) it would not: each
round trip would move the base by up to half a rounding step, and the base is also the KL
reference, so those weights are copied before the merge and put back bit for bit after
(memory for one copy of the adapted projections while the rollout runs). The merged
bfloat16 weights round the delta (by at most half a step of each weight), so the rollout's
logprobs differ from the update's by that rounding; the PPO ratio takes the rollout's as
the behaviour policy's, as with any separate inference engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from clew.errors import ConfigError
from clew.kernels.fused_lora import fuse_lora

LANGUAGE_MODEL_TARGETS = (
    r"(.*\.)?language_model\.layers\.\d+\."
    r"(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"
)


def lora_targets(target_modules: str | list[str] | None) -> str | list[str]:
    """peft's ``target_modules`` for clew's setting ("all-linear"/None: the language model)."""
    if target_modules is None or target_modules in ("all-linear", "language_model"):
        return LANGUAGE_MODEL_TARGETS
    if target_modules == "vision_and_language":
        return "all-linear"  # peft's: every linear layer but the output projection
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
        peft_model = get_peft_model(model, config)
    except ValueError as error:  # peft: "Target modules ... not found in the base model"
        raise ConfigError(f"could not add LoRA adapters: {error}") from None
    fuse_lora(peft_model)  # the scaled update inside one matmul (clew.kernels.fused_lora)
    return peft_model


def is_lora(model: torch.nn.Module) -> bool:
    return isinstance(model, PeftModel)


def _adapted_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [m.get_base_layer().weight for m in model.modules() if hasattr(m, "lora_A")]


@contextlib.contextmanager
def merged_for_rollouts(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` with its adapter merged into the base weights, unmerged on the way out.

    A no-op for a model without LoRA. Sampling only: the merged layers carry no gradient to
    the adapter. Low-precision base weights come back exactly (module docstring).
    """
    if not is_lora(model):
        yield model
        return
    with torch.no_grad():
        weights = _adapted_weights(model)
        saved = [w.clone() if w.dtype != torch.float32 else None for w in weights]
        model.merge_adapter()
    try:
        yield model
    finally:
        with torch.no_grad():
            model.unmerge_adapter()
            for w, copy in zip(weights, saved, strict=True):
                if copy is not None:
                    w.copy_(copy)
