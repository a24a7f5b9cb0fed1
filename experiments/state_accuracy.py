"""Per-state action accuracy of a maze policy along the solver's path (teacher forced).

    python experiments/state_accuracy.py MODEL [ROWS] [DEVICE]

Plays the solver on ROWS (default 64) fixed maze_2d/easy eval mazes (14 px cells, 32 turns,
current frame only), runs the policy once over each whole demonstration (the context it
would have had, had it played optimally so far) and checks the greedy action word of each
reply against the state's optimal actions. Turns are grouped by the agent cell's open
neighbours (1: dead end, 2: corridor, 3-4: junction) and by distance to the goal. Low
accuracy in corridors points at reading the frame (where am I, where are the walls); low
accuracy only at junctions far from the goal points at planning. Also prints the product
of the per-turn accuracies of each maze's optimal path: the solve rate a policy with these
per-state errors and no recovery would reach.
"""

import random
import sys
from collections import defaultdict

import torch

from clew.data.rows import generate_rows
from clew.envs import make
from clew.envs.maze.generate import DIRECTION_NAMES, DIRECTIONS
from clew.envs.maze.solver import distances_to
from clew.inference.sampling import banned_token_ids, mask_banned
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.train.batch import collate
from clew.train.sft import play_demonstration

model_dir = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 64
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
opts = {"cell_px": 14, "max_turns": 32, "action_format": "keyword"}
rows = generate_rows("maze_2d/easy", n, "eval", env_options=opts)
model, processor = load_policy(model_dir, "float32", device)
model.eval()
chat = ChatFormat(processor)
banned = banned_token_ids(chat).to(device)

hits: dict[str, list[int]] = defaultdict(list)
path_success: list[float] = []
for row in rows:
    demo = play_demonstration(row, chat, random.Random(0))
    if demo is None:
        continue
    demo.image_window = 1
    env = make(row.env_id, **row.options())
    env.reset(int(row.seed))
    dist = distances_to(env.maze, env.maze.goal)
    batch = collate([demo], chat)
    with torch.no_grad():
        logits = model(**batch.model_inputs(device), use_cache=False).logits[0]
    logits = mask_banned(logits.float(), banned)
    starts = [
        i for i in range(1, len(demo.loss_mask)) if demo.loss_mask[i] and not demo.loss_mask[i - 1]
    ]
    prob_path = 1.0
    for action, start in zip(demo.actions, starts, strict=True):
        agent = env.agent
        # A reply is "<action>", the word, "</action>": the word is predicted at ``start``.
        predicted = chat.decode([int(logits[start].argmax())]).strip()
        if agent == env.maze.goal:
            good = {"stop"}
        else:
            good = set()
            for name, (dr, dc) in zip(DIRECTION_NAMES, DIRECTIONS, strict=True):
                cell = (agent[0] + dr, agent[1] + dc)
                if env.maze.is_open(cell) and dist[cell] == dist[agent] - 1:
                    good.add(name)
        opened = sum(env.maze.is_open((agent[0] + dr, agent[1] + dc)) for dr, dc in DIRECTIONS)
        kind = (
            "goal"
            if agent == env.maze.goal
            else {1: "dead end", 2: "corridor"}.get(opened, "junction")
        )
        far = int(dist[agent])
        ok = int(predicted in good)
        hits[f"cell: {kind}"].append(ok)
        hits[f"distance {min(far, 16) // 4 * 4:2d}-{min(far, 16) // 4 * 4 + 3:2d}"].append(ok)
        hits["all"].append(ok)
        prob_path *= ok
        env.step(action)
    path_success.append(prob_path)

for key in sorted(hits):
    v = hits[key]
    print(f"{key:22s} {sum(v) / len(v):6.1%} of {len(v)} turns")
print(
    f"mazes whose whole optimal path the policy predicts: {sum(path_success) / len(path_success):.1%}"
)
