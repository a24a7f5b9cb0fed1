"""What reading the walls alone is worth: scripted policies that see every wall but do not plan.

    python experiments/heuristic_baselines.py [EPISODES_PER_MAZE] [MAX_TURNS]

On the 64 fixed maze_2d/easy eval mazes, each policy knows exactly which neighbours are
open (a perfect wall reader) and never plans a route; ties are broken at random, and a
success is standing on the goal with a turn left to stop. ``walk``: never turn back unless
at a dead end, no memory; ``dfs``: depth-first search that remembers the cells it has
seen and backtracks. Each with and without a preference for moves that bring it nearer the
goal (Manhattan distance). The gap between these and 95% is what planning must add.
"""

from __future__ import annotations

import random
import sys

from clew.data.rows import generate_rows
from clew.envs import make
from clew.envs.maze.generate import DIRECTIONS, Cell, Maze

episodes = int(sys.argv[1]) if len(sys.argv) > 1 else 50
max_turns = int(sys.argv[2]) if len(sys.argv) > 2 else 32


def step(cell: Cell, d: int) -> Cell:
    return (cell[0] + DIRECTIONS[d][0], cell[1] + DIRECTIONS[d][1])


def nearest(cells: list[Cell], goal: Cell) -> list[Cell]:
    best = min(abs(c[0] - goal[0]) + abs(c[1] - goal[1]) for c in cells)
    return [c for c in cells if abs(c[0] - goal[0]) + abs(c[1] - goal[1]) == best]


def walk(maze: Maze, toward: bool, rng: random.Random) -> bool:
    agent, came_from = maze.start, None
    for _ in range(max_turns - 1):  # the last turn is the stop
        if agent == maze.goal:
            return True
        moves = [step(agent, d) for d in range(4) if maze.is_open(step(agent, d))]
        forward = [c for c in moves if c != came_from] or moves
        choice = rng.choice(nearest(forward, maze.goal) if toward else forward)
        agent, came_from = choice, agent
    return agent == maze.goal


def dfs(maze: Maze, toward: bool, rng: random.Random) -> bool:
    stack, seen = [maze.start], {maze.start}
    for _ in range(max_turns - 1):
        if stack[-1] == maze.goal:
            return True
        here = stack[-1]
        fresh = [step(here, d) for d in range(4) if maze.is_open(step(here, d))]
        fresh = [c for c in fresh if c not in seen]
        if fresh:
            choice = rng.choice(nearest(fresh, maze.goal) if toward else fresh)
            stack.append(choice)
            seen.add(choice)
        else:
            stack.pop()
    return stack[-1] == maze.goal


options = {"cell_px": 14, "max_turns": max_turns, "action_format": "keyword"}
mazes = []
for row in generate_rows("maze_2d/easy", 64, "eval", env_options=options):
    env = make(row.env_id, **row.options())
    env.reset(int(row.seed))
    mazes.append(env.maze)
rng = random.Random(0)
print(f"64 eval mazes, {episodes} episodes each, {max_turns} turns")
for name, policy in (("walk", walk), ("dfs", dfs)):
    for toward in (False, True):
        wins = sum(policy(m, toward, rng) for m in mazes for _ in range(episodes))
        label = f"{name}{' toward the goal' if toward else ''}"
        print(f"{label:22s} {wins / (len(mazes) * episodes):6.1%} of episodes solved")
