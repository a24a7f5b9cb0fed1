"""Qwen-VL's RMSNorm (transformers' forward, the baseline) against ``clew.kernels.fused_norm``.

The four norms of a Qwen3-VL-8B layer at a prefill's shape (``--tokens`` tokens: the hidden
state's two norms of 4096, the query norm over 32 heads and the key norm over 8 heads of
128), forward alone and forward plus backward, in one run. Printed per norm: milliseconds a
call each way, the speed-up, and the fused kernel's share of the bandwidth bound (reading the
input and writing the output once, twice that with the backward, at ``--bandwidth-tbs``),
and the largest difference between the two outputs.

    python benchmarks/rms_norm.py --device cuda --tokens 17000
    python benchmarks/rms_norm.py --device cpu --tokens 512 --dtype float32
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm

from clew.kernels.fused_norm import fused_rms_norm

sys.path.insert(0, str(Path(__file__).parent))
from bounds import add_hardware_flags, hardware  # noqa: E402

SHAPES = {"hidden (x2)": (4096,), "query heads": (32, 128), "key heads": (8, 128)}


def _time(fn, device: torch.device, repeats: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=17000, help="a 192-row turn's prefill")
    p.add_argument("--repeats", type=int, default=20)
    add_hardware_flags(p)
    args = p.parse_args()
    hardware(args)  # the bounds: measured on CUDA unless given (benchmarks/bounds.py)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(
        f"RMSNorm at {args.tokens} tokens, {args.dtype} on {device}; bound at "
        f"{args.bandwidth_tbs} TB/s (input read and output written once a pass)"
    )
    print(
        f"{'norm':<12} {'pass':<9} {'original ms':>11} {'fused ms':>9} {'speed-up':>8} "
        f"{'fused of bound':>14} {'max diff':>9}"
    )
    for name, shape in SHAPES.items():
        original = Qwen3VLTextRMSNorm(shape[-1]).to(device, dtype)
        fused = copy.deepcopy(original)
        fused_rms_norm(fused)
        x = torch.randn(args.tokens, *shape, device=device, dtype=dtype)
        with torch.no_grad():
            diff = float((original(x).float() - fused(x).float()).abs().max())
        nbytes = 2 * x.numel() * x.element_size()
        for label, passes in (("forward", 1), ("+backward", 2)):
            grad = x.clone().requires_grad_(passes == 2)

            def run(norm=None, grad=grad, passes=passes):
                if passes == 1:
                    with torch.no_grad():
                        return norm(grad)
                norm(grad).backward(torch.ones_like(grad))

            a = _time(lambda run=run, norm=original: run(norm), device, args.repeats)
            b = _time(lambda run=run, norm=fused: run(norm), device, args.repeats)
            bound = passes * nbytes / (args.bandwidth_tbs * 1e12)
            print(
                f"{name:<12} {label:<9} {a * 1e3:>11.3f} {b * 1e3:>9.3f} {a / b:>7.2f}x "
                f"{bound / b:>14.1%} {diff:>9.2e}"
            )


if __name__ == "__main__":
    main()
