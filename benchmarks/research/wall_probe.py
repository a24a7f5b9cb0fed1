"""Does a maze policy read the walls next to it? A counterfactual probe on the first move.

On ``--rows`` fixed eval mazes of ``--env-id`` (14 px cells by default), the agent starts
in a corner with two inner neighbours. Where exactly one of them is open (a dead-end start,
the only move is forced; ``first_move.py``), the probe redraws the frame with those two
cells swapped (the wall opened, the floor walled) and asks the policy for its first move in
both frames. The true frame is the baseline the swapped one is read against, in the same
run: a policy that reads the walls moves its preference with the swap; a blind one keeps it.

Prints, for the dead-end starts: in how many the policy prefers the open side, in the true
and in the swapped frame (a reader: nearly all, both times; a blind policy: about half, the
same mazes' preference unchanged); the mean margin p(open) - p(wall) in both frames (a blind
policy's flips sign exactly); and how much the vision tower's output at the agent's own
cell changes with the swap, beside the change at the two swapped cells. BORDER_PX is the
env's ``border_px`` the policy was trained with (a cell then spans several patches; the
change is averaged over the patches that hold part of it). Several ``--policy`` run one after
the other and end in a table: a policy trained without a border beside one trained with it.

    python benchmarks/research/wall_probe.py --policy DIR BORDER_PX [--policy DIR BORDER_PX ...]
        [--rows 64] [--cell-px 14]

docs/learning-easy.md quotes it on the CPU for two SFT policies that git history keeps:
``git show be7077e:checkpoints/easy-h200/sft-s5/sft.tgz.part-aa | tar xzf - -C A`` (no
border, 34.4% pass@1) and ``git show b633b7b:checkpoints/easy-h200/sft-border-s10/sft.tgz.part-aa
| tar xzf - -C B`` (``border_px=7``, 51.6%), then ``--policy A/sft 0 --policy B/sft 7``. The
first prefers the open side in 16 of 37 dead-end starts and 21 of 37 swapped, margin -0.042 /
+0.042 (it flips with the swap), vision output at the agent's cell unchanged (0.000; at the
swapped cells 0.170); the second in 33 and 30 of 37, margin +0.521 / +0.372, its vision
output at the agent's patches changing by 0.510 (0.525). The port reproduces these exactly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from first_move import (  # noqa: E402
    MOVE_WORDS,
    dead_end_starts,
    first_move_batch,
    open_for_moves,
    patches_of,
    vision_tokens,
)

from clew.envs.maze.generate import Maze  # noqa: E402
from clew.envs.maze.render import render_state  # noqa: E402
from clew.models.logit_masks import banned_token_ids, mask_banned  # noqa: E402
from clew.train.forward import logits_at  # noqa: E402


def probe(model_dir: str, border_px: int, args: argparse.Namespace) -> dict[str, str]:
    """Print the figures of one policy trained on frames with ``border_px``; its summary."""
    device = args.device
    model, chat, offset, action_of = open_for_moves(model_dir, device)
    model.eval()
    banned = banned_token_ids(chat)
    patch = model.config.vision_config.patch_size

    def first_move(text: str, frame: Image.Image) -> tuple[dict[str, float], torch.Tensor]:
        """The policy's first-move distribution and the vision tower's output for ``frame``."""
        batch, keep = first_move_batch(chat, offset, [(text, frame, MOVE_WORDS[0])], device)
        with torch.no_grad():
            logits = logits_at(model, batch, keep, torch.float32)
            vision = vision_tokens(model, batch.pixel_values, batch.image_grid_thw, device)
        probs = torch.softmax(mask_banned(logits.float(), banned), -1)[0]
        return {action_of[t]: float(probs[t]) for t in action_of}, vision

    def patches_at(cell: tuple[int, int], size: int) -> list[int]:
        return patches_of(cell, size, args.cell_px, border_px, patch)

    options = {
        "cell_px": args.cell_px,
        "border_px": border_px,
        "max_turns": 32,
        "action_format": "keyword",
    }
    starts = dead_end_starts(args.env_id, args.rows, "eval", options)
    if not starts:
        sys.exit(f"no dead-end start among {args.rows} eval rows: ask for more --rows")
    before, after, agent_change, swapped_change = [], [], [], []
    for s in starts:
        maze, agent = s.maze, s.maze.start
        walls = maze.walls.copy()
        walls[s.open_cell], walls[s.wall_cell] = True, False
        swapped = Maze(walls, maze.start, maze.goal)
        p, v = first_move(s.text, s.frame)
        q, w = first_move(s.text, render_state(swapped, agent, args.cell_px, border_px))
        open_word, wall_word = MOVE_WORDS[s.open_move], MOVE_WORDS[s.wall_move]
        before.append(p[open_word] - p[wall_word])
        after.append(q[wall_word] - q[open_word])  # the walled side is the open one now
        change = (v - w).norm(dim=-1)
        agent_change.append(float(change[patches_at(agent, maze.size)].mean()))
        cells = patches_at(s.open_cell, maze.size) + patches_at(s.wall_cell, maze.size)
        swapped_change.append(float(change[cells].mean()))
    k = len(before)
    summary = {
        "prefers the open side (true / swapped frame)": (
            f"{sum(b > 0 for b in before)} / {sum(a > 0 for a in after)} of {k}"
        ),
        "mean p(open) - p(wall) (true / swapped)": f"{np.mean(before):+.3f} / {np.mean(after):+.3f}",
        "vision output change at the agent's cell / the swapped cells": (
            f"{np.mean(agent_change):.3f} / {np.mean(swapped_change):.3f}"
        ),
    }
    print(f"## {model_dir} (border_px={border_px})")
    print(f"dead-end starts: {k} of {args.rows} mazes")
    print(f"prefers the open side: {sum(b > 0 for b in before)} of {k} (true frame), "
          f"{sum(a > 0 for a in after)} of {k} (swapped frame)")  # fmt: skip
    print(f"mean margin p(open) - p(wall): {np.mean(before):+.3f} (true), "
          f"{np.mean(after):+.3f} (swapped)")  # fmt: skip
    print(f"vision output change at the agent's cell: {np.mean(agent_change):.3f}; "
          f"at the two swapped cells: {np.mean(swapped_change):.3f}")  # fmt: skip
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--policy",
        nargs=2,
        action="append",
        required=True,
        metavar=("DIR", "BORDER_PX"),
        help="a policy and the border_px of the frames it was trained on (repeatable)",
    )
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--env-id", default="maze_2d/easy")
    ap.add_argument("--cell-px", type=int, default=14)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    policies = [(d, int(b)) for d, b in args.policy]
    summaries = [probe(d, b, args) for d, b in policies]
    if len(summaries) > 1:
        print("\n| policy | " + " | ".join(summaries[0]) + " |")
        print("| --- |" + " --- |" * len(summaries[0]))
        for (d, b), s in zip(policies, summaries, strict=True):
            print(f"| {d} (border_px={b}) | " + " | ".join(s.values()) + " |")


if __name__ == "__main__":
    main()
