"""Time to make a preset's random weights on the device, against building them on the host.

The figure: ``build_model(..., device=DEVICE)`` (``clew.models.on_device``: constructed on
the meta device, allocated and drawn on DEVICE in the target dtype) and the time to save the
checkpoint. The baseline, in the same run: the ordinary host build (float32 on the CPU,
cast to the dtype) plus moving it to DEVICE, which is what a run on a GPU paid before.
Also printed: the parameter count from the config alone (``clew.models.sizes``) beside the
built model's.

    python benchmarks/preset_build.py --preset qwen3vl-8b --device cuda
    python benchmarks/preset_build.py --preset qwen3vl-8b --device cuda --vocab-size 151936
    python benchmarks/preset_build.py --preset qwen3vl-8b --device cpu --narrow

``--narrow`` keeps the 8B's depths and head ratios at widths a CPU builds in a second (a
check that the benchmark runs); ``--skip-baseline`` leaves the host build out (35 GB of
host memory for the 8B in float32).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from clew.envs.base import text_corpus
from clew.models import build_model
from clew.models.sizes import config_parameters

NARROW_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
}
NARROW_VISION = {"hidden_size": 32, "intermediate_size": 120, "num_heads": 2}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3vl-8b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    p.add_argument("--vocab-size", type=int, default=None, help="pad the tokenizer to this")
    p.add_argument("--narrow", action="store_true", help="the preset's structure, tiny widths")
    p.add_argument("--skip-baseline", action="store_true")
    args = p.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    kwargs = {
        "corpus": text_corpus(),
        "padded_vocab_size": args.vocab_size,
        "dtype": dtype,
        "overwrite": True,
    }
    if args.narrow:
        kwargs |= {"text_overrides": NARROW_TEXT, "vision_overrides": NARROW_VISION}
    with tempfile.TemporaryDirectory() as tmp:
        built = build_model(args.preset, Path(tmp) / "device", device=args.device, **kwargs)
        counted = config_parameters(built.model.config)
        print(
            f"{args.preset}{' (narrow)' if args.narrow else ''}: {built.num_parameters:,} "
            f"parameters built, {counted:,} from the config alone; "
            f"{len(built.processor.tokenizer):,} vocabulary entries; {dtype}"
        )
        print(
            f"on {args.device}: weights made in {built.build_s:.2f} s, checkpoint saved in "
            f"{built.save_s:.2f} s"
        )
        device_s = built.build_s
        del built
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        if args.skip_baseline:
            return
        host = build_model(args.preset, Path(tmp) / "host", **kwargs)
        started = time.perf_counter()
        host.model.to(args.device)
        _sync(args.device)
        moved = time.perf_counter() - started
        baseline = host.build_s + moved
        print(
            f"baseline, host build then moved to {args.device}: {baseline:.2f} s "
            f"({host.build_s:.2f} s build, {moved:.2f} s move); made on the device "
            f"{baseline / max(device_s, 1e-9):.1f}x faster"
        )


if __name__ == "__main__":
    main()
