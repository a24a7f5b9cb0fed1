"""One layer's decode attention at Qwen3-VL-8B's shape: which kernel reads the KV cache fastest.

A decode step reads the text weights once and every row's keys and values; at batch 96 to
192 over a 5- or 15-turn cache the second is a third to a half of the step's bytes
(``benchmarks/decode.py``). The engine's attention (``clew.inference.attention``) gives SDPA
a boolean mask over every row to the longest row's width rounded up to 256 columns, so
short rows are read as far as the longest. This benchmark times, for one layer, the
candidates that read each row only to its own length, against that baseline, on one batch
of rows whose lengths spread evenly over ``--min-width``..``--max-width``:

- ``sdpa_mask``: the engine's default (query heads folded onto the KV heads, the mask
  ``[B, 1, 1, W]``), over the cache's ``[B, Hkv, capacity, D]`` buffers;
- ``efficient_seqlen``: torch's memory-efficient kernel in its variable-length form
  (``seqlen_k``), every (row, KV head) one sequence of the buffers;
- ``engine_varlen``: the same kernel through the engine's ``decode_attention=varlen``
  function (``clew.inference.attention.varlen_decode``), which also builds its index of
  lengths and offsets each call, as the first layer of a step does (inside a CUDA-graph
  step that host work is gone: ``benchmarks/decode.py --caches varlen`` times the step);
- ``flash_seqused``: FlashAttention's variable-length form with ``seqused_k`` over the same
  flattening;
- ``flash_rows``: FlashAttention with one sequence a row and grouped-query attention done by
  the kernel: the query ``[B, H, D]`` as it is, the keys a strided view of the slots (row
  stride ``D``, head stride ``capacity x D``); nothing is regrouped;
- ``triton``: clew's split-KV kernel (``decode_attention=triton``,
  ``clew.kernels.split_decode``) with its default settings, and ``triton_s1`` ... with
  one of them changed (splits, columns a block, warps, pipeline stages); these replay a
  CUDA graph, as the engine's decode steps do, and so does ``efficient_graphed``, the
  ``efficient_seqlen`` call, for the comparison.

Each result is checked against ``sdpa_mask`` (largest absolute difference printed); time is
the median of ``--repeats`` calls between CUDA events, and the bound is the row's live KV
bytes at ``--bandwidth-tbs``. ``x layers`` extrapolates to a whole step's attention. A
candidate the device or torch build cannot run says why and is skipped (on a CPU,
``sdpa_mask``, the engine's CPU reference of ``engine_varlen`` and the Triton kernel in
Triton's interpreter run).

    python benchmarks/decode_attention.py --device cuda --batch 96,192
    python benchmarks/decode_attention.py --device cuda --batch 96,192 --max-width 1400
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from clew.inference.attention import varlen_decode
from clew.kernels.slot_views import row_keys
from clew.kernels.split_decode import split_decode

sys.path.insert(0, str(Path(__file__).parent))
from bounds import add_hardware_flags, candidates_header, compare_candidates, hardware  # noqa: E402

WIDTH_STEP = 256  # the engine's width bucket (clew.inference.cuda_graphs)


def graphed(call: Callable[[], torch.Tensor], dev: torch.device) -> Callable[[], torch.Tensor]:
    """``call`` replayed from a CUDA graph captured on its first call, as the engine's decode
    steps run it (a Triton kernel's launch from Python costs tens of microseconds of host
    time, which a graph does not pay); ``call`` itself on a CPU."""
    if dev.type != "cuda":
        return call
    captured: list = []

    def replay() -> torch.Tensor:
        if not captured:
            call()  # compile and warm up outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call()
            captured[:] = [graph, out]
        captured[0].replay()
        return captured[1]

    return replay


def candidates(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float
) -> dict[str, Callable[[], torch.Tensor]]:
    """Each candidate as a call returning the output ``[B, H, D]``; ``q`` [B, H, D],
    ``k``/``v`` the engine's buffers [B, Hkv, capacity, D] (each row valid to ``lengths``)."""
    b, heads, d = q.shape
    kv_heads, cap = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dev = q.device
    width = min(-(-int(lengths.max()) // WIDTH_STEP) * WIDTH_STEP, cap)
    cols = torch.arange(width, device=dev)
    mask = (cols[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, W]
    folded = q.reshape(b, kv_heads, group, d)

    def sdpa_mask() -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(
            folded, k[:, :, :width], v[:, :, :width], attn_mask=mask, scale=scale
        )
        return out.reshape(b, heads, d)

    # Every (row, KV head) one sequence of `group` queries and `cap` columns.
    n = b * kv_heads
    seqlens = lengths[:, None].expand(b, kv_heads).reshape(n).to(torch.int32)
    cu_k = torch.arange(0, (n + 1) * cap, cap, device=dev, dtype=torch.int32)
    cu_q = torch.arange(0, (n + 1) * group, group, device=dev, dtype=torch.int32)

    def efficient_seqlen() -> torch.Tensor:
        out = torch.ops.aten._efficient_attention_forward(
            folded.reshape(1, n * group, 1, d), k.reshape(1, n * cap, 1, d),
            v.reshape(1, n * cap, 1, d), None, cu_q, cu_k, group, cap, 0.0, 0, False,
            scale=scale, seqlen_k=seqlens,
        )[0]  # fmt: skip
        return out.reshape(b, heads, d)

    def engine_varlen() -> torch.Tensor:
        out = varlen_decode(q[:, :, None], k[:, :, :width], v[:, :, :width], lengths, scale)
        return out.reshape(b, heads, d)

    def flash_seqused() -> torch.Tensor:
        out = torch.ops.aten._flash_attention_forward(
            folded.reshape(n * group, 1, d), k.reshape(n * cap, 1, d), v.reshape(n * cap, 1, d),
            cu_q, cu_k, group, cap, 0.0, False, False, scale=scale, seqused_k=seqlens,
        )[0]  # fmt: skip
        return out.reshape(b, heads, d)

    cu_one = torch.arange(0, b + 1, device=dev, dtype=torch.int32)
    per_row = kv_heads * cap
    rows_k, rows_v = row_keys(k, b, cap), row_keys(v, b, cap)  # the engine's prefill view
    cu_rows_k = torch.arange(0, (b + 1) * per_row, per_row, device=dev, dtype=torch.int32)
    row_lengths = lengths.to(torch.int32)

    def flash_rows() -> torch.Tensor:
        return torch.ops.aten._flash_attention_forward(
            q, rows_k, rows_v, cu_one, cu_rows_k, 1, cap, 0.0, False, False,
            scale=scale, seqused_k=row_lengths,
        )[0]  # fmt: skip

    def triton(**settings) -> Callable[[], torch.Tensor]:
        # clew's split-KV kernel (decode_attention=triton); on a CPU, Triton's interpreter.
        def call() -> torch.Tensor:
            out = split_decode(
                q[:, :, None], k, v, lengths, scale, interpret=dev.type != "cuda", **settings
            )
            return out.reshape(b, heads, d)

        return graphed(call, dev)

    return {
        "sdpa_mask": sdpa_mask,
        "efficient_graphed": graphed(efficient_seqlen, dev),
        "triton": triton(),
        "triton_s1": triton(splits=1),
        "triton_s4": triton(splits=4),
        "triton_n128": triton(block_n=128),
        "triton_n32": triton(block_n=32),
        "triton_w8": triton(num_warps=8),
        "triton_st3": triton(num_stages=3),
        "efficient_seqlen": efficient_seqlen,
        "engine_varlen": engine_varlen,
        "flash_seqused": flash_seqused,
        "flash_rows": flash_rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", default="96,192", help="batch sizes, comma-separated")
    p.add_argument("--min-width", type=int, default=180)
    p.add_argument("--max-width", type=int, default=775)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=36, help="for the x-layers column")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    add_hardware_flags(p)
    p.add_argument("--only", default=None, help="comma-separated candidates to run")
    args = p.parse_args()
    hardware(args)  # the bounds: measured on CUDA unless given (benchmarks/bounds.py)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(
        f"decode attention, one layer: {args.heads} query / {args.kv_heads} KV heads of "
        f"{args.head_dim}, {args.dtype} on {dev}; rows {args.min_width}-{args.max_width} "
        f"tokens; bound: live KV bytes at {args.bandwidth_tbs} TB/s"
    )
    candidates_header(18)
    for b in (int(x) for x in args.batch.split(",")):
        lo, hi = args.min_width, args.max_width
        lengths = torch.tensor([lo + (hi - lo) * r // max(1, b - 1) for r in range(b)], device=dev)
        cap = -(-hi // WIDTH_STEP) * WIDTH_STEP
        shape = (b, args.kv_heads, cap, args.head_dim)
        k = torch.randn(shape, device=dev, dtype=dtype)
        v = torch.randn(shape, device=dev, dtype=dtype)
        q = torch.randn(b, args.heads, args.head_dim, device=dev, dtype=dtype)
        live = int(lengths.sum()) * args.kv_heads * args.head_dim * 2 * k.element_size()
        bound = live / (args.bandwidth_tbs * 1e12)
        runs = candidates(q, k, v, lengths, args.head_dim**-0.5)
        chosen = args.only.split(",") if args.only else list(runs)
        compare_candidates(
            runs, chosen, "sdpa_mask", batch=b, bound_s=bound, layers=args.layers, device=dev,
            repeats=args.repeats, width=18,
        )  # fmt: skip


if __name__ == "__main__":
    main()
