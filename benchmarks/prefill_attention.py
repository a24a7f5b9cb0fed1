"""One layer's prefill attention at Qwen3-VL-8B's shape: a turn's chunk over the KV cache.

A turn's prefill forward runs every row's new chunk (an observation: a frame's image tokens
and some text) over the row's whole cache. The engine's default
(``generator.inference_engine.prefill_attention=sdpa``) gives SDPA a boolean mask
``[B, 1, T, W]`` over every row to the longest row's width ``W``, so the short rows' padding
columns and the chunk's padding queries cost as much as real ones, through a kernel that
reads a mask. ``varlen`` (``clew.kernels.prefill_varlen.varlen_prefill``) reads each row to its
own length, causally, through FlashAttention's variable-length kernel. This benchmark times,
for one layer, on a batch whose rows' lengths spread evenly over
``--min-width``..``--max-width`` and whose chunks hold ``--chunk`` / 2 to ``--chunk`` new
tokens (left-padded to ``--chunk``):

- ``sdpa_mask``: the engine's masked prefill (``gqa_sdpa_attention`` with the mask
  ``SlotCache.prefill`` builds), over the cache's ``[B, Hkv, capacity, D]`` buffers;
- ``engine_varlen``: the engine's ``varlen_prefill``, its index of lengths and offsets
  included: one sequence a row, grouped-query heads done by the kernel, nothing copied (the
  queries ``[B * T, H, D]`` as the projection leaves them, the keys a strided view of the
  slots);
- ``flash_varlen``: FlashAttention's kernel alone on the other flattening, one sequence a
  (row, KV head) of ``T`` queries x the group's heads, which costs a copy of the queries to
  regroup them and one of the output back (the kernel call alone is timed here);
- ``triton``: clew's Triton kernel (``prefill_attention=triton``,
  ``clew.kernels.prefill_triton``), each KV head's query heads packed into one block of
  queries, read through the same strides as ``engine_varlen`` (Triton's interpreter on a
  CPU); ``--triton-configs M:N:WARPS:STAGES,...`` adds a candidate per kernel setting.

Each result is checked against ``sdpa_mask`` on the chunks' real tokens (largest absolute
difference printed); time is the median of ``--repeats`` calls between CUDA events. The
bound is the larger of the real tokens' attention FLOPs (``4 x keys read x head_dim`` a
query head, causal) at ``--peak-tflops`` and the live KV bytes read once at
``--bandwidth-tbs``; ``x layers`` extrapolates to a forward. On a CPU, ``sdpa_mask`` and the
engine's reference path run.

    python benchmarks/prefill_attention.py --device cuda --batch 96,192
    python benchmarks/prefill_attention.py --device cuda --batch 192 --max-width 1400
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from clew.inference.attention import gqa_sdpa_attention
from clew.kernels.prefill_triton import prefill_triton
from clew.kernels.prefill_varlen import varlen_prefill
from clew.kernels.slot_views import varlen_index

sys.path.insert(0, str(Path(__file__).parent))
from bounds import add_hardware_flags, candidates_header, compare_candidates, hardware  # noqa: E402

WIDTH_STEP = 256  # capacity rounding, as the engine's growth leaves it


def chunk_batch(
    b: int, lo: int, hi: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's length after the chunk, its real new tokens and the mask ``[B, 1, T, W]``
    ``SlotCache.prefill`` builds (every written column visible)."""
    lengths = torch.tensor([lo + (hi - lo) * r // max(1, b - 1) for r in range(b)])
    new = torch.tensor([chunk - (chunk // 2) * (r % 3) // 2 for r in range(b)]).clamp(max=lengths)
    fill = lengths - new
    j = torch.arange(chunk)[None, :]
    cols = fill[:, None] + j - (chunk - new)[:, None]  # a real token's column
    width = int(lengths.max())
    keys = torch.arange(width)[None, None, :]
    mask = (keys <= cols[:, :, None]) & (keys < lengths[:, None, None])
    return lengths, new, mask[:, None]


def candidates(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    triton_configs: tuple[tuple[int, int, int, int], ...] = (),
) -> dict[str, Callable[[], torch.Tensor]]:
    """Each candidate as a call returning ``[B, T, H, D]``; ``q`` [B, H, T, D], ``k``/``v``
    the engine's buffers [B, Hkv, capacity, D] (row ``r`` valid to ``lengths[r]``)."""
    b, heads, t, d = q.shape
    kv_heads, cap = k.shape[1], k.shape[2]
    group = heads // kv_heads
    width = mask.shape[-1]
    kw, vw = k[:, :, :width], v[:, :, :width]

    def sdpa_mask() -> torch.Tensor:
        return gqa_sdpa_attention(None, q, kw, vw, mask, scaling=scale)[0]

    def engine_varlen() -> torch.Tensor:
        return varlen_prefill(q, kw, vw, lengths, scale)

    n = b * kv_heads
    regrouped = q.reshape(b, kv_heads, group, t, d).transpose(2, 3).reshape(n * t, group, d)
    seqlens, cu_q, cu_k = varlen_index(lengths, kv_heads, cap, t)

    def flash_varlen() -> torch.Tensor:
        out = torch.ops.aten._flash_attention_forward(
            regrouped, k.reshape(n * cap, 1, d), v.reshape(n * cap, 1, d), cu_q, cu_k, t, cap,
            0.0, True, False, scale=scale, seqused_k=seqlens,
        )[0]  # fmt: skip
        out = out.reshape(b, kv_heads, t, group, d)
        return out.permute(0, 2, 1, 3, 4).reshape(b, t, heads, d)

    def triton(m: int = 128, n: int = 64, warps: int = 8, stages: int = 3):
        cpu = q.device.type != "cuda"
        return lambda: prefill_triton(
            q, kw, vw, lengths, scale, block_m=m, block_n=n, num_warps=warps,
            num_stages=stages, interpret=cpu,
        )  # fmt: skip

    runs = {"sdpa_mask": sdpa_mask, "engine_varlen": engine_varlen}
    if q.device.type == "cuda":
        runs["flash_varlen"] = flash_varlen
    runs["triton"] = triton()
    for m, n, warps, stages in triton_configs:
        runs[f"triton_{m}x{n}w{warps}s{stages}"] = triton(m, n, warps, stages)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", default="96,192", help="batch sizes, comma-separated")
    p.add_argument("--min-width", type=int, default=180, help="shortest row after the chunk")
    p.add_argument("--max-width", type=int, default=775, help="longest row after the chunk")
    p.add_argument("--chunk", type=int, default=140, help="new tokens of the longest chunk")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=36, help="for the x-layers column")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--triton-configs",
        default="",
        help="more settings of the Triton kernel to time, BLOCK_M:BLOCK_N:WARPS:STAGES, "
        "comma-separated (the default candidate is 128:64:8:3)",
    )
    add_hardware_flags(p)
    args = p.parse_args()
    hw = hardware(args)  # measured on CUDA unless given (benchmarks/bounds.py)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(
        f"prefill attention, one layer: {args.heads} query / {args.kv_heads} KV heads of "
        f"{args.head_dim}, {args.dtype} on {dev}; rows {args.min_width}-{args.max_width} "
        f"tokens after a chunk of up to {args.chunk}; bound: real attention FLOPs at "
        f"{hw.tflops:g} TFLOP/s or live KV bytes at {hw.tbs:g} TB/s"
    )
    candidates_header(14)
    for b in (int(x) for x in args.batch.split(",")):
        lengths, new, mask = chunk_batch(b, args.min_width, args.max_width, args.chunk)
        t, d = args.chunk, args.head_dim
        cap = -(-args.max_width // WIDTH_STEP) * WIDTH_STEP
        shape = (b, args.kv_heads, cap, d)
        k = torch.randn(shape, device=dev, dtype=dtype)
        v = torch.randn(shape, device=dev, dtype=dtype)
        # [B, H, T, D] as the attention gets it: a transpose of the projection's output.
        q = torch.randn(b, t, args.heads, d, device=dev, dtype=dtype).transpose(1, 2)
        # Query i of n new tokens over a row of L reads L - n + i + 1 keys.
        pairs = zip(lengths.tolist(), new.tolist(), strict=True)
        reads = sum(n * (length - n) + n * (n + 1) // 2 for length, n in pairs)
        flops = 4 * reads * args.heads * d
        live = int(lengths.sum()) * args.kv_heads * d * 2 * k.element_size()
        bound = max(hw.compute_s(flops), hw.memory_s(live))
        real = torch.arange(t)[None, :] >= (t - new)[:, None]
        configs = tuple(
            tuple(int(x) for x in c.split(":")) for c in args.triton_configs.split(",") if c
        )
        runs = candidates(q, k, v, lengths.to(dev), mask.to(dev), d**-0.5, configs)
        real = real.to(dev)
        compare_candidates(
            runs, list(runs), "sdpa_mask", batch=b, bound_s=bound, layers=args.layers,
            device=dev, repeats=args.repeats, width=14, pick=lambda out, real=real: out[real],
        )  # fmt: skip


if __name__ == "__main__":
    main()
