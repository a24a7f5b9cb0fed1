"""One decoder layer's linear layers at decode batch sizes: separate against merged weights.

A decode step at Qwen3-VL-8B's shape reads the text weights once (13.9 GB) and each
layer's projections are matrix products of a few hundred rows: they are bound by the
weight read, and the narrow ones (the key and value projections, 1,024 outputs each) tend
to use the bandwidth worse than the wide ones. Inference engines such as vLLM therefore
keep the query, key and value weights as one matrix and the gate and up weights as another,
one product each. This benchmark times, for one layer and each batch size:

- ``separate``: q, k, v, o, gate, up and down as seven products (what transformers' layer
  runs, and clew's engine today);
- ``merged``: one qkv product, o, one gate-up product and down (four products, the same
  bytes).

Time is the median of ``--repeats`` calls of the layer's products between CUDA events;
the bound is the larger of the layer's weight bytes at ``--bandwidth-tbs`` and its
``2 x batch x weights`` FLOPs at ``--peak-tflops`` (both measured on the card unless given;
at batch 192 the two are close). ``x layers`` extrapolates to a whole step's 36 layers.

    python benchmarks/decode_linears.py --device cuda --batch 96,192
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bounds import add_hardware_flags, call_seconds, hardware  # noqa: E402


def layer_weights(
    hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, dev, dtype
) -> dict[str, torch.Tensor]:
    """A layer's projection weights, ``[out, in]`` as ``nn.Linear`` keeps them."""
    shapes = {
        "q": (heads * head_dim, hidden),
        "k": (kv_heads * head_dim, hidden),
        "v": (kv_heads * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate": (inter, hidden),
        "up": (inter, hidden),
        "down": (hidden, inter),
    }
    return {n: torch.randn(s, device=dev, dtype=dtype) * 0.02 for n, s in shapes.items()}


def variants(
    w: dict[str, torch.Tensor], x: torch.Tensor, attn: torch.Tensor, act: torch.Tensor
) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """Each variant's products for one layer: ``x`` the normed hidden states [M, hidden],
    ``attn`` the attention output [M, heads x head_dim], ``act`` the MLP activation
    [M, intermediate] (inputs fixed, so only the products are timed)."""
    qkv = torch.cat([w["q"], w["k"], w["v"]])
    gate_up = torch.cat([w["gate"], w["up"]])

    def separate() -> list[torch.Tensor]:
        outs = [F.linear(x, w[n]) for n in ("q", "k", "v", "gate", "up")]
        return outs + [F.linear(attn, w["o"]), F.linear(act, w["down"])]

    splits = [w[n].shape[0] for n in ("q", "k", "v")], [w[n].shape[0] for n in ("gate", "up")]

    def merged() -> list[torch.Tensor]:  # split into views, in the separate order
        a, g = F.linear(x, qkv), F.linear(x, gate_up)
        outs = [*a.split(splits[0], dim=-1), *g.split(splits[1], dim=-1)]
        return outs + [F.linear(attn, w["o"]), F.linear(act, w["down"])]

    return {"separate": separate, "merged": merged}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", default="96,192", help="batch sizes, comma-separated")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--layers", type=int, default=36, help="for the x-layers column")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    add_hardware_flags(p)
    args = p.parse_args()
    hw = hardware(args)  # the bounds: measured on CUDA unless given (benchmarks/bounds.py)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    w = layer_weights(
        args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate, dev, dtype
    )
    nbytes = sum(t.numel() * t.element_size() for t in w.values())
    params = sum(t.numel() for t in w.values())
    print(
        f"one decoder layer's linears: hidden {args.hidden}, {args.heads} query / "
        f"{args.kv_heads} KV heads of {args.head_dim}, MLP {args.intermediate}, {args.dtype} "
        f"on {dev}; {nbytes / 1e6:.1f} MB of weights, {hw.memory_s(nbytes) * 1e6:.1f} us at "
        f"{hw.tbs:g} TB/s; bound: that or the FLOPs at {hw.tflops:g} TFLOP/s"
    )
    print(
        f"{'variant':<10} {'batch':>5} {'us':>9} {'of bound':>8} {'x layers ms':>11} "
        f"{'vs separate':>11} {'max diff':>9}"
    )
    for m in (int(b) for b in args.batch.split(",")):
        bound = max(hw.memory_s(nbytes), hw.compute_s(2 * m * params))
        x = torch.randn(m, args.hidden, device=dev, dtype=dtype)
        attn = torch.randn(m, args.heads * args.head_dim, device=dev, dtype=dtype)
        act = torch.randn(m, args.intermediate, device=dev, dtype=dtype)
        fns = variants(w, x, attn, act)
        reference = torch.cat([t.flatten() for t in fns["separate"]()]).float()
        base = None
        for name, fn in fns.items():
            out = fn()
            diff = (torch.cat([t.flatten() for t in out]).float() - reference).abs().max()
            sec = statistics.median(call_seconds(fn, dev, args.repeats, warmup=3))
            base = base or sec
            print(
                f"{name:<10} {m:>5} {sec * 1e6:>9.1f} {bound / sec:>8.1%} "
                f"{sec * args.layers * 1e3:>11.2f} {base / sec:>10.2f}x {float(diff):>9.2e}"
            )


if __name__ == "__main__":
    main()
