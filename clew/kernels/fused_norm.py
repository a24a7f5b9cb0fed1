"""The language model's RMSNorms as one fused kernel instead of seven element-wise passes.

Qwen-VL's RMSNorm (``Qwen2VLRMSNorm``, ``Qwen3VLTextRMSNorm`` and their kin) upcasts its
input to float32, squares it, averages, adds epsilon, takes ``rsqrt``, multiplies, casts
back and multiplies by the weight: seven kernels, each a full pass over the activations,
four of them in float32. A Qwen3-VL layer has four such norms (two on the hidden state, one
per query and key head), and at 8B a prefill is GPU-bound: in a 192-episode rollout
element-wise kernels (multiplications, additions, copies and casts, means, powers) took
close to as much GPU time as the matrix products (``benchmarks/rollout.py --trace``).
``torch.nn.functional.rms_norm`` computes the same
``weight * x / sqrt(mean(x^2) + eps)`` in one fused kernel on CUDA (forward and backward),
accumulating in float32 as the original does; on the CPU it is torch's composite of the
same operations.

``fused_rms_norm(model)`` replaces the ``forward`` of each known RMSNorm class whose weight
has the input's dtype (a bf16 policy); with float32 weights under bf16 autocast, where the
original's dtype promotion matters, the original forward runs. Parameters, checkpoints and
training are unchanged; results are equal up to summation order and the one rounding to
the input's dtype (the original rounds before the weight multiplication, the kernel after).
Why not transformers' own hook: ``use_kernel_forward_from_hub`` fetches kernels from the
Hugging Face Hub, and clew downloads nothing at run time.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

__all__ = ["fused_rms_norm"]

# The classes whose forward is exactly the computation above (transformers 5.17-5.25).
RMS_NORMS = frozenset(
    {
        "Qwen2RMSNorm",
        "Qwen2VLRMSNorm",
        "Qwen2_5_VLRMSNorm",
        "Qwen3RMSNorm",
        "Qwen3VLTextRMSNorm",
    }
)


def _fused_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if hidden_states.dtype != weight.dtype:
        return type(self).forward(self, hidden_states)
    return F.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)


def fused_rms_norm(model: torch.nn.Module) -> int:
    """Give every known RMSNorm of ``model`` the fused forward; returns how many changed."""
    changed = 0
    for module in model.modules():
        if (
            type(module).__name__ in RMS_NORMS
            and hasattr(module, "variance_epsilon")
            and getattr(module, "_clew_fused_norm", False) is False
        ):
            module.forward = types.MethodType(_fused_forward, module)
            module._clew_fused_norm = True
            changed += 1
    return changed
