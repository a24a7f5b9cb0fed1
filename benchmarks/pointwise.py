"""The element-wise work of a layer at Qwen3-VL-8B's shapes: transformers' code against the
compiled kernels of ``clew.kernels.fused_pointwise``, in one run.

For each shape (a decode step of ``--batch`` rows, one query each; a prefill of
``--prefill-tokens`` tokens; the vision tower over ``--patches`` patches) it times, for one
layer, transformers' rotary embedding and SwiGLU gate (and the vision rotary) against the
fused kernels, and prints the bound: the bytes each function must read and write once at
``--bandwidth-tbs`` (measured on the card unless given). ``x layers`` extrapolates to the
36 language layers (27 vision blocks). The first fused call compiles; it is left out.

    python benchmarks/pointwise.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3

from clew.kernels import fused_pointwise
from clew.kernels.fused_pointwise import pointwise_fused, rotary, rotary_vision, silu_mul

sys.path.insert(0, str(Path(__file__).parent))
from bounds import add_hardware_flags, call_seconds, hardware  # noqa: E402


def _original(name: str) -> Callable:
    fn = getattr(qwen3, name)
    return getattr(fn, "_clew_original", fn)


def cases(args: argparse.Namespace, dev: torch.device, dtype: torch.dtype):
    """(name, layers, transformers' call, the fused call, bytes read and written once)."""
    heads, kv, d, inter = 32, 8, 128, 12288

    def nbytes(*ts: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    original = _original("apply_rotary_pos_emb")
    out = []
    for label, b, t in (
        (f"decode, {args.batch} rows", args.batch, 1),
        (f"prefill, {args.prefill_tokens} tokens", 1, args.prefill_tokens),
    ):
        q = torch.randn(b, t, heads, d, device=dev, dtype=dtype).transpose(1, 2)
        k = torch.randn(b, t, kv, d, device=dev, dtype=dtype).transpose(1, 2)
        cos = torch.randn(b, t, d, device=dev, dtype=dtype)
        sin = torch.randn(b, t, d, device=dev, dtype=dtype)
        gate = torch.randn(b, t, inter, device=dev, dtype=dtype)
        up = torch.randn(b, t, inter, device=dev, dtype=dtype)
        out.append(
            (
                f"rotary, {label}",
                36,
                lambda q=q, k=k, c=cos, s=sin: original(q, k, c, s),
                lambda q=q, k=k, c=cos, s=sin: fused_pointwise._fused("rotary", rotary, q, k, c, s, 1),
                2 * nbytes(q, k) + nbytes(cos, sin),
            )
        )  # fmt: skip
        out.append(
            (
                f"gate, {label}",
                36,
                lambda g=gate, u=up: torch.nn.functional.silu(g) * u,
                lambda g=gate, u=up: fused_pointwise._fused("silu_mul", silu_mul, g, u),
                nbytes(gate, up) + nbytes(gate),
            )
        )
    s, vh, vd = args.patches, 16, 72
    q = torch.randn(s, vh, vd, device=dev, dtype=dtype)
    k = torch.randn(s, vh, vd, device=dev, dtype=dtype)
    cos = torch.randn(s, vd, device=dev, dtype=torch.float32)
    sin = torch.randn(s, vd, device=dev, dtype=torch.float32)
    original_v = _original("apply_rotary_pos_emb_vision")
    out.append(
        (
            f"vision rotary, {s} patches",
            27,
            lambda: original_v(q, k, cos, sin),
            lambda: fused_pointwise._fused("rotary_vision", rotary_vision, q, k, cos, sin),
            2 * nbytes(q, k) + nbytes(cos, sin),
        )
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=192, help="rows of a decode step")
    p.add_argument("--prefill-tokens", type=int, default=27000, help="tokens of a prefill")
    p.add_argument("--patches", type=int, default=49152, help="vision patches of a prefill")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    add_hardware_flags(p)
    args = p.parse_args()
    hw = hardware(args)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    fused_pointwise.COMPILE_DEVICES.add(dev.type)  # a CPU run compiles through Inductor's C++
    torch.manual_seed(0)
    print(
        f"element-wise work of one layer, {args.dtype} on {dev}; bound: bytes read and "
        f"written once at {hw.tbs:g} TB/s"
    )
    print(
        f"{'function':<38} {'eager us':>9} {'fused us':>9} {'speed-up':>8} {'bound us':>9} "
        f"{'fused of bound':>14} {'saved x layers ms':>17} {'max diff':>9}"
    )
    with pointwise_fused():
        for name, layers, eager, fused, nbytes in cases(args, dev, dtype):
            want, got = eager(), fused()  # the first fused call compiles
            want = want if isinstance(want, tuple) else (want,)
            got = got if isinstance(got, tuple) else (got,)
            diff = max(
                float((a.float() - b.float()).abs().max()) for a, b in zip(got, want, strict=True)
            )
            t_eager = statistics.median(call_seconds(eager, dev, args.repeats, warmup=2))
            t_fused = statistics.median(call_seconds(fused, dev, args.repeats, warmup=2))
            bound = hw.memory_s(nbytes)
            print(
                f"{name:<38} {t_eager * 1e6:>9.1f} {t_fused * 1e6:>9.1f} "
                f"{t_eager / t_fused:>7.2f}x {bound * 1e6:>9.1f} {bound / t_fused:>14.1%} "
                f"{(t_eager - t_fused) * layers * 1e3:>17.2f} {diff:>9.2e}"
            )


if __name__ == "__main__":
    main()
