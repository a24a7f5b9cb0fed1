"""Grouped-query decode attention over the ``SlotCache``'s slots, each row's keys split
over several programs (split-KV, "flash-decoding"), as two Triton kernels.

Why written here: a decode step of an 8B policy at large batches spends a large share of its
time in attention, and torch ships no kernel for this shape. Its memory-efficient kernel
(``decode_attention=varlen``) read the KV cache well below the rate the card's own copies
reach, and its FlashAttention build was no faster (BENCHMARKS.md); the decode kernels of
FlashInfer and vLLM do not install beside every torch clew supports. This is the plan of
SGLang's and vLLM's Triton decode kernels, written for clew's cache layout:

- ``split_kernel``, one program a (row, KV head, split): it loads the ``group`` query heads
  that share the KV head (padded to 16, the matrix units' smallest tile) and reads its share
  of the row's first ``length`` columns of that KV head once, ``BLOCK_N`` columns at a time,
  with an online softmax; it writes the split's output and log-sum-exp in float32. The keys
  and values are the slot buffers ``[slots, kv_heads, capacity, head_dim]`` read through
  their strides: nothing is copied, expanded or masked;
- ``combine_kernel``, one program a (row, query head): the splits' outputs weighted by
  their share of the softmax.

How many splits (``splits_for``): enough programs to fill the card when the rows are few,
one when rows x KV heads already do; fixed per row count, so a CUDA graph keeps its grid.
An empty split (a short row) writes a log-sum-exp of minus infinity and weighs nothing.

Measured one layer at Qwen3-VL-8B's shape, replayed from a CUDA graph
(``benchmarks/decode_attention.py``; BENCHMARKS.md): faster than the memory-efficient kernel,
and closer to the bound its KV bytes set.

On a CPU, Triton's interpreter runs the same kernels (``interpret=True``): what the tests
compare with SDPA, and what the engine runs there when asked for ``decode_attention=triton``
(``decode_attention=auto`` takes the kernels on CUDA only; ``clew.inference.attention``).
"""

from __future__ import annotations

import math

import torch

from clew.kernels.triton_loading import interpreter, kernels

BLOCK_H = 16  # query heads a program computes: the group padded to the matrix tile
BLOCK_N = 64  # key columns a program reads at a time
PROGRAMS_PER_SM = 8  # splits_for: programs a streaming multiprocessor is given at least
MAX_SPLITS = 32


def splits_for(sequences: int, device: torch.device) -> int:
    """Splits a row's keys go to: about ``PROGRAMS_PER_SM`` programs an SM over the
    ``sequences`` (rows x KV heads), at most ``MAX_SPLITS``; 1 on a CPU."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-PROGRAMS_PER_SM * sms // max(1, sequences))
    return max(1, min(MAX_SPLITS, 1 << (want - 1).bit_length()))


def split_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    *,
    splits: int | None = None,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> torch.Tensor:
    """One query a row, ``query`` [B, H, 1, D], over ``key``/``value`` [B, Hkv, W, D] (views
    of ``SlotCache`` buffers, or any tensors whose last dimension is contiguous), row ``r``
    reading its first ``lengths[r]`` columns; returns [B, 1, H, D] in the query's dtype.
    ``splits``, ``block_n``, ``num_warps`` and ``num_stages``: the kernels' settings (the
    module's defaults; benchmarks/decode_attention.py tries others)."""
    b, heads, t, d = query.shape
    kv_heads = key.shape[1]
    if t != 1 or heads % kv_heads or heads // kv_heads > BLOCK_H:
        raise ValueError(
            f"split_decode takes one query a row and at most {BLOCK_H} query heads a KV "
            f"head; got {t} queries, {heads} query heads over {kv_heads} KV heads"
        )
    if min(query.stride(-1), key.stride(-1), value.stride(-1)) != 1:
        raise ValueError("split_decode needs the head dimension contiguous")
    group = heads // kv_heads
    splits = splits or splits_for(b * kv_heads, query.device)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dev = query.device
    part = torch.empty((b, heads, splits, d), dtype=torch.float32, device=dev)
    lse = torch.empty((b, heads, splits), dtype=torch.float32, device=dev)
    out = torch.empty((b, 1, heads, d), dtype=query.dtype, device=dev)
    if interpret and query.dtype == torch.bfloat16:
        # The interpreter's bf16 products are wrong (numpy has no bf16): compute in float32.
        query, key, value = query.float(), key.float(), value.float()
    module = kernels("split_decode_kernels", interpret)
    split_kernel, combine_kernel = module.split_kernel, module.combine_kernel
    block_d = 1 << (d - 1).bit_length()
    with interpreter(interpret):
        _launch(
            split_kernel, combine_kernel, query, key, value, lengths, part, lse, out, scale,
            group, d, block_d, block_n, splits, num_warps, num_stages,
        )  # fmt: skip
    return out


def _launch(
    split_kernel, combine_kernel, query, key, value, lengths, part, lse, out, scale,
    group, d, block_d, block_n, splits, num_warps, num_stages,
) -> None:  # fmt: skip
    b, kv_heads, heads = query.shape[0], key.shape[1], query.shape[1]
    split_kernel[(b, kv_heads, splits)](
        query, key, value, lengths, part, lse, scale,
        query.stride(0), query.stride(1),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=BLOCK_H, BLOCK_N=block_n,
        SPLITS=splits, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    combine_kernel[(b, heads)](
        part, lse, out,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(2),
        HEAD_DIM=d, BLOCK_D=block_d, SPLITS=splits, BLOCK_S=max(2, 1 << (splits - 1).bit_length()),
    )  # fmt: skip
