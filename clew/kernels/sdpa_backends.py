"""Which of PyTorch's scaled-dot-product attention kernels clew's forwards may run.

All but cuDNN's. Where it applies, PyTorch's dispatcher prefers cuDNN's fused attention on
recent NVIDIA cards, and cuDNN builds an execution plan on the host for every input shape it
has not seen. The shapes of clew's attention calls change from call to call: a rollout's
prefill reads a cache that grows every turn, an update's micro-batches are as long as their
longest episode. So the plan is built at almost every call, and for a small policy that host
work took longer than the forward's kernels (``benchmarks/recipe_steps.py --profile``). The
flash and memory-efficient kernels, and the math fallback, have no per-shape setup.

Gradient checkpointing recomputes forwards during backward, so a training pass holds the
choice over its backward too.
"""

from __future__ import annotations

import contextlib

from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["ALLOWED_BACKENDS", "without_cudnn_attention"]

ALLOWED_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def without_cudnn_attention() -> contextlib.AbstractContextManager:
    """Within the block, SDPA picks among ``ALLOWED_BACKENDS`` only."""
    return sdpa_kernel(list(ALLOWED_BACKENDS))
