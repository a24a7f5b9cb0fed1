"""How a maze policy's failed eval episodes went, replayed from ``clew eval``'s trajectories.

    python experiments/failure_modes.py EVAL_DIR/trajectories.jsonl

Replays each unsolved episode in its env and prints the optimal turns (moves + stop), the
moves that did not bring the agent closer to the goal (a wall bump or a step away), how
often it stepped back onto a cell it had already visited, its final distance to the goal,
and whether it ever stood on the goal (and did not stop there). Then the counts by outcome.
A reactive policy (current frame only) that takes a wrong branch and comes back takes the
same branch again: many revisits and a far final distance point at that loop.
"""

import json
import sys
from collections import Counter
from pathlib import Path

from clew.envs import make
from clew.envs.maze.solver import distances_to

rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines()]
outcomes: Counter = Counter()
for r in rows:
    if r["success"]:
        outcomes["solved"] += 1
        continue
    env = make(r["env_id"], **r["env_options"])
    env.reset(r["seed"])
    dist = distances_to(env.maze, env.maze.goal)
    optimal = int(dist[env.maze.start]) + 1
    visited, reached, revisits, astray = {env.agent}, False, 0, 0
    for action in r["actions"]:
        before = int(dist[env.agent])
        _, _, done, info = env.step(action)
        if info["event"] == "wall" or (info["event"] == "moved" and int(dist[env.agent]) > before):
            astray += 1
        if info["event"] == "moved" and env.agent in visited:
            revisits += 1
        visited.add(env.agent)
        reached |= env.agent == env.maze.goal
        if done:
            break
    outcome = "on the goal, no stop" if reached else "never reached the goal"
    outcomes[outcome] += 1
    print(
        f"seed {r['seed']}: optimal {optimal:2d} turns, played {r['turns']}, astray {astray:2d}, "
        f"revisits {revisits:2d}, final distance {int(dist[env.agent]):2d}, {outcome}"
    )
print(", ".join(f"{k}: {v}" for k, v in outcomes.most_common()))
