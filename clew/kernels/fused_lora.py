"""LoRA layers whose adapter update is added inside one matrix product.

peft's LoRA ``Linear`` computes ``result = base(x) + lora_B(lora_A(x)) * scaling``: after
the base projection, the adapter's output, its scaling and the sum each make a tensor the
size of the projection's output (six passes over it, reads and writes), and the scaling's
backward two more. The rank-32 products themselves are cheap; the passes are not: the q, k,
v, o, gate, up and down projections of a Qwen3-VL-8B layer have 38,912 output features, so
at a micro-batch of 8,192 tokens a pass over them moves 0.64 GB. ``torch.addmm(result, h,
B.T, alpha=scaling)`` with ``h = lora_A(x)`` does the scaled sum in the product's epilogue,
reading ``result`` once and writing the sum once, and its backward passes the gradient of
``result`` through unchanged: six passes fewer a layer, about 0.14 TB fewer bytes an
8,192-token micro-batch over 36 layers, time an update spends on memory traffic alone. The
values are
the same up to rounding (the scaling applied to the accumulator rather than to the rounded
product).

``fuse_lora(model)`` gives every peft LoRA ``Linear`` of a model this forward (a subclass,
so merging, saving and peft's own checks are unchanged); ``fuse_lora(model, False)`` puts
peft's back (``benchmarks/update.py --configs peft_lora`` times the two). The fused path
runs for plain LoRA only: dropout, DoRA and other variants, per-row adapters
(``adapter_names``), merged or disabled adapters take peft's forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLinear

__all__ = ["FusedLoraLinear", "fuse_lora"]


class FusedLoraLinear(PeftLinear):
    """peft's LoRA ``Linear`` with the adapter's scaled update added by ``addmm``."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or self.disable_adapters or self.merged or self.lora_variant:
            return super().forward(x, *args, **kwargs)
        adapters = [a for a in self.active_adapters if a in self.lora_A]
        if any(not isinstance(self.lora_dropout[a], torch.nn.Identity) for a in adapters):
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)
        dtype, shape = result.dtype, result.shape
        flat = result.reshape(-1, shape[-1])
        autocast = torch.is_autocast_enabled(x.device.type)
        for name in adapters:
            a, b = self.lora_A[name].weight, self.lora_B[name].weight
            # Under autocast the product runs in the autocast dtype whatever x's: peft's cast
            # of the activations to a float32 adapter's dtype would be cast straight back,
            # two copies of x (and two in backward) for the very same values.
            h = F.linear(x if autocast else self._cast_input_dtype(x, a.dtype), a)
            h = h.reshape(-1, a.shape[0])
            # Outside autocast a float32 adapter over a bf16 base promotes, as peft's sum does.
            if flat.dtype != h.dtype and not autocast:
                flat = flat.to(torch.promote_types(flat.dtype, h.dtype))
            flat = torch.addmm(flat, h, b.t().to(h.dtype), alpha=self.scaling[name])
        return flat.reshape(shape).to(dtype)


def fuse_lora(model: torch.nn.Module, fused: bool = True) -> int:
    """Give every LoRA ``Linear`` of ``model`` the fused forward (``fused=False``: peft's);
    returns how many layers changed."""
    source, target = (PeftLinear, FusedLoraLinear) if fused else (FusedLoraLinear, PeftLinear)
    changed = 0
    for module in model.modules():
        if type(module) is source:
            module.__class__ = target
            changed += 1
    return changed
