"""Where the frame's information goes in an untrained Qwen3-VL policy (CPU, a minute).

    python experiments/frame_path_trace.py [BORDER] [--image-mean M] [--image-std S] [--position-table T] [--preset P]

Builds the ``--preset`` policy (`small` unless given; ``clew init-model`` with the given
flags), feeds it 64 frames of the fixed eval mazes (one agent cell each, the planning
probes' states) and, at each stage of the vision tower up to the image embeddings the
language model receives, splits the activations' energy into three shares: one vector
shared by every patch of every frame (``const``), what depends on the patch's place but
not the frame (``pos``: the tower's position table, and the maze cells that are wall or
floor in every maze), and what varies with the frame (``content``: the maze itself and the
agent). A language model can only learn from the last.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from pixel_planning_probe import CELL, Frames, states, to_device
from planning_probe import SIZE, probe_mazes

from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("border", type=int, nargs="?", default=0)
    ap.add_argument("--image-mean", type=float)
    ap.add_argument("--image-std", type=float)
    ap.add_argument("--position-table", default="sincos")
    ap.add_argument("--preset", default="small")
    args = ap.parse_args()
    eval_mazes, _ = probe_mazes()
    picked = states(eval_mazes)[::30][:64]
    folder = tempfile.mkdtemp(prefix="trace")
    build_model(
        args.preset,
        folder,
        arch="qwen3_vl",
        image_size=SIZE * CELL + 2 * args.border,
        patch_size=CELL,
        merge_size=1,
        image_mean=None if args.image_mean is None else [args.image_mean] * 3,
        image_std=None if args.image_std is None else [args.image_std] * 3,
        position_table=args.position_table,
        overwrite=True,
    )
    model, processor = load_policy(folder)
    inputs = to_device(Frames(ChatFormat(processor), eval_mazes, args.border).batch(picked), "cpu")
    n = len(picked)

    def shares(name: str, x: torch.Tensor) -> None:
        x = x.float().reshape(n, -1, x.shape[-1])
        total = x.pow(2).mean()
        const = x.mean((0, 1))
        place = x.mean(0) - const
        content = x - x.mean(0)
        print(f"{name:22s} rms {total.sqrt():.3f} | const {const.pow(2).mean() / total:.2f} "
              f"pos {place.pow(2).mean() / total:.2f} content {content.pow(2).mean() / total:.2f}")  # fmt: skip

    vision = model.model.visual
    hooks = [vision.patch_embed.register_forward_hook(lambda m, a, o: shares("patch embedding", o))]
    for i, block in enumerate(vision.blocks):
        hooks.append(
            block.register_forward_hook(lambda m, a, o, i=i: shares(f"vision block {i}", o))
        )
    hooks.append(vision.merger.register_forward_hook(lambda m, a, o: shares("image embeddings", o)))
    with torch.no_grad():
        model.model(**inputs)
    for hook in hooks:
        hook.remove()


if __name__ == "__main__":
    main()
