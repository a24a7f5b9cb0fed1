"""The vision tower's patch embedding as one matrix product instead of a 3-D convolution.

Qwen2-VL and Qwen3-VL embed each patch with ``nn.Conv3d`` whose kernel equals its stride
(``temporal_patch_size x patch_size x patch_size``) over inputs already cut into patches:
every output is one dot product of a whole patch with each filter, i.e. a linear layer over
the flattened patch. The convolution pays for generality it does not use (on the CPU it was
a large share of a serving prefill of one image a row, tiny preset), and on CUDA its kernels are
a known slow path for this shape; ``F.linear`` on the same weights, viewed as
``[embed_dim, in_channels * t * p * p]``, computes the same dot products (equal up to
summation order).

``linear_patch_embed(model)`` replaces the ``forward`` of each such module; the parameters
stay the convolution's (checkpoints, LoRA targets and training are unchanged). A module
whose layout this code does not recognise is left alone.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

__all__ = ["linear_patch_embed"]


def _linear_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    proj = self.proj
    weight = proj.weight
    flat = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
    return F.linear(flat, weight.reshape(weight.shape[0], -1), proj.bias)


def _is_patch_conv(module: torch.nn.Module) -> bool:
    proj = getattr(module, "proj", None)
    return (
        isinstance(proj, torch.nn.Conv3d)
        and tuple(proj.kernel_size) == tuple(proj.stride)
        and tuple(proj.padding) == (0, 0, 0)
        and tuple(proj.dilation) == (1, 1, 1)
        and proj.groups == 1
        and hasattr(module, "temporal_patch_size")
        and hasattr(module, "patch_size")
    )


def linear_patch_embed(model: torch.nn.Module) -> int:
    """Give every patch-embedding convolution of ``model`` the linear forward; returns how
    many modules changed (0 for a model without one)."""
    changed = 0
    for module in model.modules():
        if _is_patch_conv(module) and getattr(module, "_clew_linear_patch", False) is False:
            module.forward = types.MethodType(_linear_forward, module)
            module._clew_linear_patch = True
            changed += 1
    return changed
