"""Where the frame's information goes in an untrained Qwen3-VL policy (CPU, a minute).

Builds the ``--preset`` policy twice from the same seed (14 px patches over 14 px cells,
merge size 1): with ``clew init-model``'s defaults (the baseline: sin-cos position table,
pixel normalization 0.5 / 0.5) and with ``--image-mean``, ``--image-std`` and
``--position-table`` as given (by default the values docs/learning-easy.md recommends).
Both read the same 64 frames of the 64 fixed ``maze_2d/easy`` eval mazes (every 30th of
their open cells but the goal, the agent on it). At each stage of the vision tower up to the
image embeddings the language model receives, the activations' energy is split into three
shares: one vector shared by every patch of every frame (``const``), what depends on the
patch's place but not the frame (``pos``: the position table, and the cells that are wall
or floor in every maze), and what varies with the frame (``content``: the maze itself and
the agent). A language model can only learn from the last.

    python benchmarks/research/frame_path_trace.py [--border 0] [--preset small]
        [--image-mean 0.83] [--image-std 0.5] [--position-table centered]

docs/learning-easy.md quotes the content share at the image embeddings of the `small`
preset: 0.03 with the default build (const 0.80, pos 0.18) and 0.25 with
``--image-mean 0.83,0.83,0.83 --image-std 0.5,0.5,0.5 --position-table centered`` (const
0.15, pos 0.60), at border 0; at border 7, 0.04 and 0.25. The port prints the same.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from clew.data.rows import generate_rows
from clew.envs import make
from clew.envs.maze.generate import Cell, Maze
from clew.envs.maze.render import render_state
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat
from clew.models.pixels import as_patches

CELL, SIZE = 14, 9


def probe_frames(border: int) -> list:
    """64 frames of the 64 fixed eval mazes: every 30th (maze, open cell but the goal)."""
    picked: list[tuple[Maze, Cell]] = []
    for row in generate_rows("maze_2d/easy", 64, "eval"):
        env = make(row.env_id, **row.options())
        env.reset(int(row.seed))
        rows, cols = np.nonzero(env.distances() > 0)
        picked += [(env.maze, (int(r), int(c))) for r, c in zip(rows, cols, strict=True)]
    return [render_state(maze, cell, CELL, border) for maze, cell in picked[::30][:64]]


def trace(folder: Path, frames: list) -> float:
    """Print each stage's shares for the policy in ``folder``; the image embeddings' content."""
    model, processor = load_policy(folder)
    pixels, grid = ChatFormat(processor).encode_frames(frames)
    n, content_share = len(frames), 0.0

    def shares(name: str, x: torch.Tensor) -> None:
        nonlocal content_share
        x = x.float().reshape(n, -1, x.shape[-1])
        total = x.pow(2).mean()
        const = x.mean((0, 1))
        place = x.mean(0) - const
        content = (x - x.mean(0)).pow(2).mean() / total
        content_share = float(content)
        print(f"{name:22s} rms {total.sqrt():.3f} | const {const.pow(2).mean() / total:.2f} "
              f"pos {place.pow(2).mean() / total:.2f} content {content:.2f}")  # fmt: skip

    vision = model.model.visual
    hooks = [vision.patch_embed.register_forward_hook(lambda m, a, o: shares("patch embedding", o))]
    for i, block in enumerate(vision.blocks):
        hooks.append(
            block.register_forward_hook(lambda m, a, o, i=i: shares(f"vision block {i}", o))
        )
    hooks.append(vision.merger.register_forward_hook(lambda m, a, o: shares("image embeddings", o)))
    with torch.no_grad():
        vision(as_patches(pixels, "cpu"), grid_thw=grid)
    for hook in hooks:
        hook.remove()
    return content_share  # the merger runs last: the image embeddings' share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--border", type=int, default=0, help="the env's border_px")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--image-mean", type=float, default=0.83, help="one value for R, G, B")
    ap.add_argument("--image-std", type=float, default=0.5, help="one value for R, G, B")
    ap.add_argument("--position-table", default="centered")
    args = ap.parse_args()
    frames = probe_frames(args.border)
    flags = (
        f"--image-mean {args.image_mean} --image-std {args.image_std} "
        f"--position-table {args.position_table}"
    )
    builds = {
        "default build (baseline)": {},
        flags: {
            "image_mean": [args.image_mean] * 3,
            "image_std": [args.image_std] * 3,
            "position_table": args.position_table,
        },
    }
    content = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in builds.items():
            print(f"## {args.preset}, border {args.border}, {name}")
            folder = Path(tmp) / str(len(content))
            size = SIZE * CELL + 2 * args.border
            build_model(
                args.preset,
                folder,
                arch="qwen3_vl",
                image_size=size,
                patch_size=CELL,
                merge_size=1,
                overwrite=True,
                **extra,
            )
            content[name] = trace(folder, frames)
    print("content share at the image embeddings: "
          + "; ".join(f"{name} {share:.2f}" for name, share in content.items()))  # fmt: skip


if __name__ == "__main__":
    main()
