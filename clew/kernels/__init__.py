"""Custom kernels and fused operations: Triton attention kernels, fused norms and pointwise ops.

Each module replaces one operation of a Qwen-VL forward by a faster one with the same
values (up to kernel rounding), and is switched in by the model loader (``clew.models``),
the engine (``clew.inference``) or the policy worker (``clew.train``). Nothing here
imports from those packages: a kernel takes tensors and plain layouts.
"""
