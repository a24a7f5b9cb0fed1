"""The vision tower's patch embedding: the convolution against the matrix product, in one run.

Times the patch-embedding module of ``--preset``'s vision tower on ``--frames`` frames of
``--image-size`` px (their patches as the processor lays them out), first with
transformers' ``Conv3d`` forward (the baseline), then with ``clew.kernels.patch_embed``'s
``F.linear`` on the same weights, and prints milliseconds per call, patches/s and the
speed-up, with the largest difference between the two outputs.

    python benchmarks/patch_embed.py --preset tiny --frames 64 --image-size 140
    python benchmarks/patch_embed.py --preset qwen3vl-8b --device cuda --frames 192 --image-size 252
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from clew.kernels.patch_embed import linear_patch_embed
from clew.models import build_model


def _timed(module, x: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        out = module(x)  # warm-up
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = module(x)
        if x.device.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats, out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--frames", type=int, default=64)
    p.add_argument("--image-size", type=int, default=140)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        built = build_model(
            args.preset, tmp, image_size=args.image_size, device=args.device if cuda else None
        )
    linear = next(
        m for m in built.model.modules() if isinstance(getattr(m, "proj", None), torch.nn.Conv3d)
    )
    linear_patch_embed(linear)  # already so in a built or loaded policy
    proj = linear.proj
    shape = (proj.in_channels, *proj.kernel_size)

    def conv(x: torch.Tensor) -> torch.Tensor:  # transformers' forward: the Conv3d itself
        return proj(x.view(-1, *shape)).view(x.shape[0], -1)

    width = proj.weight[0].numel()
    per_frame = (args.image_size // proj.kernel_size[1]) ** 2
    x = torch.randn(args.frames * per_frame, width, device=proj.weight.device)
    x = x.to(proj.weight.dtype)
    base_s, want = _timed(conv, x, args.repeats)
    fast_s, got = _timed(linear, x, args.repeats)
    n = x.shape[0]
    print(
        f"{args.preset} patch embedding ({width} -> {proj.out_channels}, {proj.weight.dtype}) on "
        f"{proj.weight.device}: {args.frames} frames of {args.image_size} px, {n} patches"
    )
    print(f"{'path':<10} {'ms/call':>9} {'patches/s':>12}")
    for name, s in (("conv3d", base_s), ("linear", fast_s)):
        print(f"{name:<10} {1000 * s:>9.3f} {n / s:>12,.0f}")
    diff = (got.float() - want.float()).abs().max().item()
    print(f"speed-up {base_s / fast_s:.2f}x; largest difference {diff:.2e}")


if __name__ == "__main__":
    main()
