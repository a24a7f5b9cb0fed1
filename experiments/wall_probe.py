"""Does a maze policy read the walls next to it? A counterfactual probe on the first move.

    python experiments/wall_probe.py MODEL [ROWS] [ENV_ID] [CELL_PX]

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
itself, and reading the neighbours is left to the language model).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from clew.data.rows import generate_rows
from clew.envs import make
from clew.envs.maze.actions import Action, format_action
from clew.envs.maze.generate import DIRECTIONS, Maze
from clew.envs.maze.render import render_state
from clew.inference.sampling import banned_token_ids, mask_banned
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.train.agreement import decision_tokens
from clew.train.batch import collate
from clew.train.sft import Demonstration
from clew.train.worker import logits_at

model_dir = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 64
env_id = sys.argv[3] if len(sys.argv) > 3 else "maze_2d/easy"
cell_px = int(sys.argv[4]) if len(sys.argv) > 4 else 14
model, processor = load_policy(model_dir, "float32", "cpu")
model.eval()
chat = ChatFormat(processor)
decision = decision_tokens(chat, "keyword")
if decision is None:
    sys.exit("the keyword action format has no single decision token with this tokenizer")
offset, action_of = decision
banned = banned_token_ids(chat)
words = [format_action(Action("move", d), "keyword") for d in range(len(DIRECTIONS))]


def first_move(text: str, image) -> tuple[dict[str, float], torch.Tensor]:
    """The policy's first-move distribution and the vision tower's output for ``image``."""
    chunk = chat.user_turn(text, [image], first=True, after_reply_end=True, pixels=False)
    reply = chat.reply_tokens(words[0])
    n_prompt = len(chunk.token_ids)
    demo = Demonstration(
        list(chunk.token_ids) + list(reply), [0] * n_prompt + [1] * len(reply), [image]
    )
    demo.chunk_starts, demo.image_window = [0], 1
    batch = collate([demo], chat)
    keep = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    keep[0, n_prompt + offset - 1] = True
    with torch.no_grad():
        logits = logits_at(model, batch, keep, torch.float32)
        vision = model.model.visual(batch.pixel_values.patches(), grid_thw=batch.image_grid_thw)
    probs = torch.softmax(mask_banned(logits.float(), banned), -1)[0]
    return {action_of[t]: float(probs[t]) for t in action_of}, vision.pooler_output


opts = {"cell_px": cell_px, "max_turns": 32, "action_format": "keyword"}
rows = generate_rows(env_id, n, "eval", env_options=opts)
before, after, agent_change, swapped_change = [], [], [], []
for row in rows:
    env = make(row.env_id, **row.options())
    obs = env.reset(int(row.seed))
    maze, agent = env.maze, env.maze.start
    inner = [
        (d, (agent[0] + dr, agent[1] + dc))
        for d, (dr, dc) in enumerate(DIRECTIONS)
        if 0 < agent[0] + dr < maze.size - 1 and 0 < agent[1] + dc < maze.size - 1
    ]
    if len(inner) != 2 or maze.is_open(inner[0][1]) == maze.is_open(inner[1][1]):
        continue  # both open: a junction start, nothing forced
    (d_open, c_open), (d_wall, c_wall) = sorted(inner, key=lambda x: not maze.is_open(x[1]))
    walls = maze.walls.copy()
    walls[c_open], walls[c_wall] = True, False
    p, v = first_move(obs.text, obs.images[0])
    q, w = first_move(obs.text, render_state(Maze(walls, maze.start, maze.goal), agent, cell_px))
    before.append(p[words[d_open]] - p[words[d_wall]])
    after.append(q[words[d_wall]] - q[words[d_open]])  # the formerly walled side is open now
    side = maze.size
    change = (v - w).norm(dim=-1)
    agent_change.append(float(change[agent[0] * side + agent[1]]))
    swapped_change.append(float(change[[c[0] * side + c[1] for c in (c_open, c_wall)]].mean()))
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
