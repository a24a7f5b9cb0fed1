"""The vision tower over one SFT batch of frames: batched attention beside transformers'.

Baseline: transformers' Qwen3-VL vision tower as loaded (sdpa, one attention call per
image per layer). clew: the same weights with ``batch_vision_attention`` (one call per
layer for same-size images), then also ``share_vision_positions`` (the rotary position
ids of one image, repeated, instead of built image by image). Forward and backward of the tower's features, best of
``--repeats``; on CUDA the time includes a synchronize.

    python benchmarks/vision_attention.py [--frames 912] [--preset small] [--device cpu]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from clew.kernels.vision_attention import batch_vision_attention, share_vision_positions
from clew.models import build_model
from clew.models.chat import ChatFormat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=912)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        built = build_model(
            args.preset,
            Path(tmp) / "m",
            image_size=126,
            patch_size=14,
            merge_size=1,
            arch="qwen3_vl",
        )
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    baseline = built.model.to(args.device, dtype).train()
    ours = copy.deepcopy(baseline)
    batch_vision_attention(ours)
    positions = copy.deepcopy(ours)
    share_vision_positions(positions)
    rng = np.random.default_rng(0)
    frames = [
        Image.fromarray(rng.integers(0, 256, (126, 126, 3), dtype=np.uint8))
        for _ in range(args.frames)
    ]
    pixels, grid = ChatFormat(built.processor).encode_images(frames)
    pixels, grid = pixels.to(args.device, dtype), grid.to(args.device)

    def step(model: torch.nn.Module) -> None:
        out = model.model.get_image_features(pixels, grid)
        feats = getattr(out, "pooler_output", out)
        feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
        feats.float().square().mean().backward()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    for name, model in (
        ("transformers, per image (baseline)", baseline),
        ("clew, batched attention", ours),
        ("clew, batched + shared positions", positions),
    ):
        step(model)
        best = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            step(model)
            best = min(best, time.perf_counter() - t)
        print(f"{name:36s} {best * 1000:8.1f} ms forward+backward, {args.frames} frames")

    # The position ids alone: the host-side loop that sharing removes.
    from transformers.vision_utils import get_vision_position_ids

    def per_image() -> torch.Tensor:
        return get_vision_position_ids(grid, 1)

    def shared() -> torch.Tensor:
        return get_vision_position_ids(grid[:1], 1).repeat(len(grid), 1)

    assert torch.equal(per_image(), shared())
    for name, fn in (
        ("position ids, per image (baseline)", per_image),
        ("position ids, shared", shared),
    ):
        best = float("inf")
        for _ in range(max(args.repeats, 3)):
            t = time.perf_counter()
            fn()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        print(f"{name:36s} {best * 1000:8.1f} ms, {args.frames} frames")


if __name__ == "__main__":
    main()
