"""How a maze policy played its eval episodes, replayed from ``clew eval``'s trajectories.

    python experiments/failure_modes.py EVAL_DIR/trajectories.jsonl

Replays every episode in its env. For each unsolved one it prints the optimal turns
(moves + stop), the moves that did not bring the agent closer to the goal (a wall bump or
a step away), how often it stepped back onto a cell it had already visited, its final
distance to the goal, and whether it ever stood on the goal (and did not stop there).
Then, over all episodes, the share of turns whose move was optimal, by the agent's cell
(corridor, junction, dead end: 2, 3+ or 1 open neighbours; also all turns and the first
move, off the goal) and by whether the agent had
stood there before in that episode (a wall bump leaves it where it was, so a second bump
counts as a revisit): the policy's own-play counterpart of
``experiments/state_accuracy.py`` (which feeds it the solver's path). A reactive policy
(current frame only) that takes a wrong branch and comes back takes the same branch again:
low accuracy on revisited junctions points at that loop. Last, how often a wall bump was
followed by the same move: the env's reply says "hit a wall moving X; you did not move"
and the frame is unchanged, so a policy that reads only the frame repeats the bump.
"""

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from clew.envs import make
from clew.envs.maze.generate import DIRECTIONS
from clew.envs.maze.solver import distances_to

rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines()]
outcomes: Counter = Counter()
repeats: list[bool] = []  # per wall bump with a next turn: was the next move the same?
good: dict[str, list[bool]] = defaultdict(list)
for r in rows:
    env = make(r["env_id"], **r["env_options"])
    env.reset(r["seed"])
    maze = env.maze
    dist = distances_to(maze, maze.goal)
    optimal = env.turns_needed()  # from this episode's start (start_anywhere moves it)
    seen: Counter = Counter()
    reached, revisits, astray, bumped = False, 0, 0, False
    for turn, action in enumerate(r["actions"]):
        if turn > 0 and bumped:
            repeats.append(action == r["actions"][turn - 1])
        here = env.agent
        seen[here] += 1
        before = int(dist[here])
        _, _, done, info = env.step(action)
        closer = info["event"] == "moved" and int(dist[env.agent]) < before
        if here != maze.goal:
            opened = sum(maze.is_open((here[0] + dr, here[1] + dc)) for dr, dc in DIRECTIONS)
            kind = {1: "dead end", 2: "corridor"}.get(opened, "junction")
            good[f"{kind}, {'first visit' if seen[here] == 1 else 'revisit'}"].append(closer)
            good["all turns"].append(closer)
            if turn == 0:
                good["the first move"].append(closer)
        bumped = info["event"] == "wall"
        if bumped or (info["event"] == "moved" and not closer):
            astray += 1
        if info["event"] == "moved" and seen[env.agent] > 0:
            revisits += 1
        reached |= env.agent == maze.goal
        if done:
            break
    if r["success"]:
        outcomes["solved"] += 1
        continue
    outcome = "on the goal, no stop" if reached else "never reached the goal"
    outcomes[outcome] += 1
    print(
        f"seed {r['seed']}: optimal {optimal:2d} turns, played {r['turns']}, astray {astray:2d}, "
        f"revisits {revisits:2d}, final distance {int(dist[env.agent]):2d}, {outcome}"
    )
print(", ".join(f"{k}: {v}" for k, v in outcomes.most_common()))
print("optimal moves in the policy's own play:")
for key in sorted(good):
    v = good[key]
    print(f"  {key:24s} {sum(v) / len(v):6.1%} of {len(v)} turns")
if repeats:
    print(
        f"wall bumps followed by the same move: {sum(repeats) / len(repeats):.1%} of {len(repeats)}"
    )
