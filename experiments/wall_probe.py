"""Does a maze policy read the walls next to it? A counterfactual probe on the first move.

    python experiments/wall_probe.py MODEL [ROWS] [ENV_ID] [CELL_PX] [BORDER_PX]

On ROWS (default 64) fixed eval mazes (maze_2d/easy, 14 px cells by default), the agent
starts in a corner with two inner neighbours. Where exactly one of them is open (a dead-end
start, the only move is forced), the probe redraws the frame with those two cells swapped
(the wall opened, the floor walled) and asks the policy for its first move in both frames.
A policy that reads the walls moves its preference with the swap; a blind one keeps it.

Prints, for the dead-end starts: how many mazes the policy prefers the open side in, before
and after the swap (a reader: nearly all, both times; a blind policy: about half, and the
same mazes' preference unchanged); the mean margin p(open) - p(wall) in both frames; and
how much the vision tower's output at the agent's own cell changes with the swap, beside
the change at the two swapped cells (near zero at the agent: the tower keeps each cell to
itself, and reading the neighbours is left to the language model). With BORDER_PX (the
env's ``border_px``, for a policy trained on framed images) a cell spans several patches;
the change is averaged over the patches that hold part of it.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from _first_move import MOVE_WORDS, dead_end_starts, first_move_batch, open_for_moves, patches_of

from clew.envs.maze.generate import Maze
from clew.envs.maze.render import render_state
from clew.inference.sampling import banned_token_ids, mask_banned
from clew.train.worker import logits_at

model_dir = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 64
env_id = sys.argv[3] if len(sys.argv) > 3 else "maze_2d/easy"
cell_px = int(sys.argv[4]) if len(sys.argv) > 4 else 14
border_px = int(sys.argv[5]) if len(sys.argv) > 5 else 0
model, chat, offset, action_of = open_for_moves(model_dir, "cpu")
model.eval()
banned = banned_token_ids(chat)
words = MOVE_WORDS


def first_move(text: str, frame) -> tuple[dict[str, float], torch.Tensor]:
    """The policy's first-move distribution and the vision tower's output for ``frame``."""
    batch, keep = first_move_batch(chat, offset, [(text, frame, words[0])], "cpu")
    with torch.no_grad():
        logits = logits_at(model, batch, keep, torch.float32)
        vision = model.model.visual(batch.pixel_values.patches(), grid_thw=batch.image_grid_thw)
    probs = torch.softmax(mask_banned(logits.float(), banned), -1)[0]
    return {action_of[t]: float(probs[t]) for t in action_of}, vision.pooler_output


opts = {"cell_px": cell_px, "border_px": border_px, "max_turns": 32, "action_format": "keyword"}
patch = model.config.vision_config.patch_size


def patches_at(cell: tuple[int, int], size: int) -> list[int]:
    return patches_of(cell, size, cell_px, border_px, patch)


starts = dead_end_starts(env_id, n, "eval", opts)
before, after, agent_change, swapped_change = [], [], [], []
for s in starts:
    maze, agent = s.maze, s.maze.start
    walls = maze.walls.copy()
    walls[s.open_cell], walls[s.wall_cell] = True, False
    p, v = first_move(s.text, s.frame)
    q, w = first_move(
        s.text, render_state(Maze(walls, maze.start, maze.goal), agent, cell_px, border_px)
    )
    before.append(p[words[s.open_move]] - p[words[s.wall_move]])
    after.append(q[words[s.wall_move]] - q[words[s.open_move]])  # the walled side is open now
    change = (v - w).norm(dim=-1)
    agent_change.append(float(change[patches_at(agent, maze.size)].mean()))
    cells = patches_at(s.open_cell, maze.size) + patches_at(s.wall_cell, maze.size)
    swapped_change.append(float(change[cells].mean()))
k = len(before)
print(f"dead-end starts: {k} of {n} mazes")
print(
    f"prefers the open side: {sum(b > 0 for b in before)} of {k} (true frame), "
    f"{sum(a > 0 for a in after)} of {k} (swapped frame)"
)
print(
    f"mean margin p(open) - p(wall): {np.mean(before):+.3f} (true), {np.mean(after):+.3f} (swapped)"
)
print(
    f"vision output change at the agent's cell: {np.mean(agent_change):.3f}; "
    f"at the two swapped cells: {np.mean(swapped_change):.3f}"
)
