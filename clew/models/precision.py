"""Mixed precision: which dtype a policy's weights load in, and the bfloat16 compute context.

``trainer.bf16`` means what Hugging Face Trainer's ``bf16=True`` means: weights that train
stay float32 and matmuls and attention run in bfloat16 under ``torch.autocast``. Weights
trained in bfloat16 itself lose updates: bfloat16 keeps 8 significant bits, so an AdamW
step of lr 2e-4 on a weight of 0.05 is about one unit in the last place, and on a norm
weight of 1.0 it rounds away entirely. clew's GPU runs before this module trained the
small policy that way (GRPO moved it barely, approximate KL about 1e-4). Frozen weights
lose nothing, so under LoRA the base model loads in bfloat16 (half the memory) and peft
keeps the adapters in float32 (``autocast_adapter_dtype``).

The rollout engine samples under the same context as the trainer scores, so the PPO ratio
starts at 1 up to bfloat16 rounding rather than a float32-bfloat16 gap.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from clew.errors import ConfigError

if TYPE_CHECKING:  # torch loads where the policy does, not when the CLI parses its flags
    import torch

__all__ = ["PRECISIONS", "bf16_autocast", "policy_precision"]

# Named as PyTorch Lightning names them.
PRECISIONS = ("bf16-mixed", "bf16-true", "32-true")


def policy_precision(device: torch.device, precision: str, lora: bool) -> tuple[str, bool]:
    """``(weights dtype name, autocast)`` for a policy on ``device``.

    ``bf16-mixed``: float32 weights (bfloat16 for a frozen LoRA base), bfloat16 compute;
    ``bf16-true``: bfloat16 weights and compute; ``32-true``: float32 throughout. bfloat16
    only on CUDA: elsewhere every precision is ``32-true`` (a CPU without bfloat16 units
    runs it slower than float32).
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if device.type != "cuda" or precision == "32-true":
        return "float32", False
    if precision == "bf16-true":
        return "bfloat16", True
    return ("bfloat16" if lora else "float32"), True


def bf16_autocast(
    device: torch.device, enabled: bool, *, cache: bool = True
) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to bfloat16 on ``device``'s type when ``enabled``, else a no-op.
    ``cache=False`` casts a weight anew at each use instead of once per context: what a CUDA
    graph capture needs (``torch.cuda.make_graphed_callables`` requires it too). A cast
    cached during a capture is freed when the context exits while the graph still reads it;
    uncached, every cast is a kernel of the graph, so each replay recasts the weights the
    optimizer has since updated in place."""
    if not enabled:
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)
