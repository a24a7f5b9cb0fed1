"""A turn's prefill attention over the ``SlotCache``'s slots as one Triton kernel, each KV
head's query heads folded into the kernel's query block.

Why written here: at many-turn widths the attention of a Qwen3-VL-8B prefill forward ran far
below the card's matrix rate (``benchmarks/rollout.py --prefill-kernels``; BENCHMARKS.md).
torch's FlashAttention build (``prefill_attention=varlen``) computes each query
head's chunk as its own sequence in blocks of 128 queries, so a chunk of 140 tokens fills
two blocks, the second with 12; FlashAttention 3 and FlashInfer, which pack a KV head's
query heads into one block, do not install beside every torch clew supports. The plan here is
theirs, for clew's cache layout:

- one program a (block of ``BLOCK_M`` queries, KV head, row); a row's queries are its
  ``T x group`` (position, query head) pairs in position order, so a block holds
  ``BLOCK_M / group`` consecutive positions of all the heads that share the KV head, and a
  140-token chunk of 4 heads a KV head fills 5 blocks of 128 (560 of 640 places used);
- the program reads the row's columns of that KV head once, ``BLOCK_N`` at a time, with an
  online softmax: first the columns all its positions see (no mask), then, masked, those up
  to its last position's ``length - T + j`` (the chunk is left-padded: a row's real tokens
  are its last queries and its last columns); a query that sees no column gives zero;
- keys and values are the slot buffers ``[slots, kv_heads, capacity, head_dim]`` read
  through their strides, the queries the projection's output through theirs: nothing is
  copied, expanded or masked, and the output is written as ``[B, T, H, D]``.

On a CPU, Triton's interpreter runs the same kernel (``interpret=True``), in float32 for a
bf16 input as numpy has no bf16: what the tests compare with masked SDPA.
"""

from __future__ import annotations

import math

import torch

from clew.kernels.triton_loading import interpreter, kernels

BLOCK_M = 128  # (position, query head) pairs a program computes
BLOCK_N = 64  # key columns it reads at a time


def prefill_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    *,
    starts: torch.Tensor | None = None,
    max_new: int = 0,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    num_warps: int = 8,
    num_stages: int = 3,
    interpret: bool = False,
) -> torch.Tensor:
    """A chunk of ``T`` queries a row, ``query`` [B, H, T, D] left-padded, over ``key`` /
    ``value`` [B, Hkv, W, D] (views of ``SlotCache`` buffers, or any tensors whose last
    dimension is contiguous): row ``r``'s query ``j`` attends to columns up to
    ``lengths[r] - T + j``. Returns [B, T, H, D] in the query's dtype. With ``starts``
    [B + 1] the chunks are packed instead: ``query`` [1, H, N, D] holds row ``r``'s
    ``starts[r + 1] - starts[r]`` queries from position ``starts[r]``, at most ``max_new``
    a row, and the result is [1, N, H, D]. ``block_m``, ``block_n``, ``num_warps`` and
    ``num_stages``: the kernel's settings (the module's defaults;
    ``benchmarks/prefill_attention.py`` tries others)."""
    b, heads, t, d = query.shape
    kv_heads = key.shape[1]
    rows = b if starts is None else lengths.shape[0]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    if min(query.stride(-1), key.stride(-1), value.stride(-1)) != 1:
        raise ValueError("prefill_triton needs the head dimension contiguous")
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty((b, t, heads, d), dtype=query.dtype, device=query.device)
    if query.dtype != key.dtype:  # the products in the cache's dtype (float32 under autocast)
        query = query.to(key.dtype)
    if interpret and query.dtype == torch.bfloat16:
        # The interpreter's bf16 products are wrong (numpy has no bf16): compute in float32.
        query, key, value = query.float(), key.float(), value.float()
    kernel = kernels("prefill_triton_kernels", interpret).prefill_kernel
    packed = starts is not None
    t_grid = max_new if packed else t
    grid = (max(1, -(-t_grid * group // block_m)), kv_heads, rows)
    q_b, o_b = (0, 0) if packed else (query.stride(0), out.stride(0))
    with interpreter(interpret):
        kernel[grid](
            query, key, value, lengths, starts if packed else lengths, out, scale, t,
            q_b, query.stride(1), query.stride(2),
            key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2),
            o_b, out.stride(1), out.stride(2),
            GROUP=group, HEAD_DIM=d, BLOCK_D=1 << (d - 1).bit_length(),
            BLOCK_M=block_m, BLOCK_N=block_n, PACKED=packed,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out
