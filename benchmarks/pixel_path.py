"""A maze frame's pixel patches: each Qwen-VL image processor against clew's fast path for it.

For ``maze_2d/easy``'s first frame (225 px, ``make("maze_2d/easy").reset(0).images[0]``) and
each geometry (Qwen2-VL's patch 14 with CLIP's mean and std; Qwen3-VL's patch 16 with
0.5 / 0.5; both resize the frame to 224 px, 8 x 28 and 7 x 32), times both of transformers'
image processors, the baseline, beside ``clew.models.pixels`` for the same processor in the
same run:

- ``Qwen2VLImageProcessorPil``, the PIL one clew loads everywhere;
- ``Qwen2VLImageProcessor``, the torchvision-backed one that transformers builds and loads
  where torchvision is installed. Where torchvision cannot be imported its
  rows are skipped with a message.

Columns: milliseconds per frame of the processor (``ip(images=..., return_tensors="pt")``),
of ``fast_patches`` (the same float patches on the host) and of ``fast_frames`` (the bytes
that rollouts and training batches carry, patched later on the model's device), and the
speed-up of ``fast_patches`` over the processor. Both outputs are checked equal, value for
value, before timing. The frame cache (``clew.models.frame_cache``) is off unless
``--frame-cache`` is given, so every call resizes as for a frame seen the first time.

    python benchmarks/pixel_path.py [--frames 1] [--repeats 200] [--threads 1] [--frame-cache]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from clew.envs import make
from clew.models.frame_cache import frame_cache
from clew.models.pixels import fast_frames, fast_patches
from clew.models.processor import image_processor_kwargs, make_image_processor
from clew.models.torchvision_pixels import is_torchvision_processor

# name: (patch size, image mean and std; None: CLIP's, the processor's default)
GEOMETRIES: dict[str, tuple[int, float | None]] = {"qwen2_vl": (14, None), "qwen3_vl": (16, 0.5)}


def _torchvision_processor(kwargs: dict[str, Any]) -> tuple[Any | None, str]:
    """The torchvision-backed processor, or ``None`` and why it cannot run here."""
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - an ImportError, or a torch it does not match
        return None, f"torchvision not importable here ({type(exc).__name__}: {exc})"
    from transformers import Qwen2VLImageProcessor

    ip = Qwen2VLImageProcessor(**kwargs)
    if not is_torchvision_processor(ip):
        return None, f"transformers gave {type(ip).__name__}, not the torchvision-backed class"
    return ip, ""


def _per_call(fn: Callable[[], Any], repeats: int) -> float:
    """Seconds per call: the best of 5 rounds (this machine's other work only adds time)."""
    fn()  # warm-up: the fast path checks the processor once per frame size here
    rounds = max(1, repeats // 5)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(rounds):
            fn()
        best = min(best, (time.perf_counter() - t0) / rounds)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--env", default="maze_2d/easy")
    p.add_argument("--frames", type=int, default=1, help="frames per call (one a turn: 1)")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--frame-cache", action="store_true", help="keep resized frames by content")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not args.frame_cache:
        frame_cache.capacity_bytes = 0
    frame = make(args.env).reset(0).images[0]
    frames = [frame.copy() for _ in range(args.frames)]
    cache = "on" if args.frame_cache else "off (every call resizes)"
    print(
        f"{args.env} frame {frame.size[0]}x{frame.size[1]} {frame.mode}, {args.frames} frame(s) "
        f"a call, {args.threads} torch thread(s), frame cache {cache}"
    )
    header = (
        f"{'geometry':<9} {'processor':<25} {'size':>8} {'processor ms':>13} "
        f"{'fast_patches ms':>16} {'fast_frames ms':>15} {'speed-up':>9}"
    )
    print(header)
    for name, (patch, norm) in GEOMETRIES.items():
        kwargs = image_processor_kwargs(
            patch_size=patch,
            image_mean=None if norm is None else [norm] * 3,
            image_std=None if norm is None else [norm] * 3,
        )
        tv_ip, why = _torchvision_processor(kwargs)
        for ip in (make_image_processor(**kwargs), tv_ip):
            if ip is None:
                print(f"{name:<9} {'Qwen2VLImageProcessor':<25} skipped: {why}")
                continue
            ref = ip(images=frames, return_tensors="pt")
            fast = fast_patches(frames, ip)
            if fast is None:
                print(f"{name:<9} {type(ip).__name__:<25} not covered by the fast path")
                continue
            if not (
                torch.equal(fast[0], ref["pixel_values"])
                and torch.equal(fast[1], ref["image_grid_thw"])
            ):
                raise SystemExit(f"{type(ip).__name__}: the fast path's values differ")
            grid = ref["image_grid_thw"][0]
            size = f"{int(grid[1]) * patch}x{int(grid[2]) * patch}"
            n = args.frames
            slow = _per_call(lambda ip=ip: ip(images=frames, return_tensors="pt"), args.repeats) / n
            quick = _per_call(lambda ip=ip: fast_patches(frames, ip), args.repeats) / n
            held = _per_call(lambda ip=ip: fast_frames(frames, ip), args.repeats) / n
            print(
                f"{name:<9} {type(ip).__name__:<25} {size:>8} {slow * 1e3:>13.3f} "
                f"{quick * 1e3:>16.3f} {held * 1e3:>15.3f} {slow / quick:>8.1f}x"
            )


if __name__ == "__main__":
    main()
