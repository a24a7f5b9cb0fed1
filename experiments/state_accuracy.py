"""Per-state action accuracy of a maze policy along the solver's path (teacher forced).

    python experiments/state_accuracy.py MODEL [ROWS] [DEVICE] [BORDER_PX]

Runs ``clew.train.agreement.solver_predictions`` on ROWS (default 64) fixed maze_2d/easy
eval mazes (14 px cells, 32 turns, current frame only; BORDER_PX the env's ``border_px``
for a policy trained on framed images) and prints the share of turns where
the policy's most likely action is optimal, by the agent's cell (dead end, corridor,
junction, goal) and by distance to the goal: low accuracy in corridors points at reading
the frame, low accuracy only at junctions far from the goal at planning. Also prints the
share of mazes whose whole optimal path the policy predicts: the solve rate a policy with
these per-state errors and no recovery would reach, and how the wrong picks split between a
move into a wall (the frame misread) and an open but wrong way (the route misplanned).
Last, junction accuracy by the length of the junction's longest side branch (the dead-end
walk a planner must follow to rule it out): a drop with length points at the planning horizon.
"""

import sys
from collections import defaultdict

from clew.data.rows import generate_rows
from clew.envs import make
from clew.envs.maze.actions import Action, format_action
from clew.envs.maze.generate import DIRECTIONS
from clew.envs.maze.solver import distances_to
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.train.agreement import solver_predictions

model_dir = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 64
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
border_px = int(sys.argv[4]) if len(sys.argv) > 4 else 0
opts = {"cell_px": 14, "border_px": border_px, "max_turns": 32, "action_format": "keyword"}
rows = generate_rows("maze_2d/easy", n, "eval", env_options=opts)
model, processor = load_policy(model_dir, "float32", device)
predictions = solver_predictions(model, ChatFormat(processor), rows, image_window=1)

hits: dict[str, list[int]] = defaultdict(list)
whole_path: dict[int, bool] = defaultdict(lambda: True)
for p in predictions:
    ok = p.predicted in p.optimal
    for group in p.groups:
        hits[group].append(ok)
    whole_path[p.row] &= ok
for key in sorted(hits):
    v = hits[key]
    print(f"{key:14s} {sum(v) / len(v):6.1%} of {len(v)} turns")
print(
    f"mazes whose whole optimal path the policy predicts: {sum(whole_path.values()) / len(whole_path):.1%}"
)


def path_cells(row) -> tuple:
    """The cells of the solver's path from the start, one per turn."""
    env = make(row.env_id, **row.options())
    env.reset(int(row.seed))
    maze, dist = env.maze, distances_to(env.maze, env.maze.goal)
    cells = [maze.start]
    while cells[-1] != maze.goal:
        r, c = cells[-1]
        steps = [(r + dr, c + dc) for dr, dc in DIRECTIONS]
        cells.append(next(x for x in steps if maze.is_open(x) and dist[x] == dist[r, c] - 1))
    return maze, cells


moves = {format_action(Action("move", d), "keyword"): d for d in range(len(DIRECTIONS))}
kinds: dict[str, int] = defaultdict(int)
paths = {}


def path_of(row: int) -> tuple:
    """``path_cells`` of eval row ``row``, computed once."""
    if row not in paths:
        paths[row] = path_cells(rows[row])
    return paths[row]


for p in predictions:
    if p.predicted in p.optimal:
        continue
    maze, cells = path_of(p.row)
    if p.predicted in moves and p.turn < len(cells):
        dr, dc = DIRECTIONS[moves[p.predicted]]
        cell = (cells[p.turn][0] + dr, cells[p.turn][1] + dc)
        kinds["into a wall" if not maze.is_open(cell) else "open but wrong"] += 1
    else:
        kinds["stop or other"] += 1
total = len(predictions)
print(
    "wrong picks: "
    + ", ".join(f"{k} {v / total:.1%}" for k, v in sorted(kinds.items()))
    + " of turns"
)


def side_branch_length(maze, cell, came_from, towards) -> int:
    """Cells of the longest walk into a side branch at ``cell`` (not back, not the way on).

    In a perfect maze a cell lies in the branch through neighbour ``n`` when it is one move
    closer to ``n`` than to ``cell``; its distance to ``cell`` is then the walk's length.
    """
    to_cell = distances_to(maze, cell)
    longest = 0
    for dr, dc in DIRECTIONS:
        n = (cell[0] + dr, cell[1] + dc)
        if n in (came_from, towards) or not maze.is_open(n):
            continue
        branch = (distances_to(maze, n) == to_cell - 1) & (to_cell > 0)
        longest = max(longest, int(to_cell[branch].max()))
    return longest


buckets: dict[str, list[int]] = defaultdict(list)
for p in predictions:
    if "junction" not in p.groups:
        continue
    maze, cells = path_of(p.row)
    if p.turn + 1 >= len(cells):
        continue
    back = cells[p.turn - 1] if p.turn > 0 else None
    length = side_branch_length(maze, cells[p.turn], back, cells[p.turn + 1])
    key = "1-2" if length <= 2 else "3-5" if length <= 5 else "6-10" if length <= 10 else "11+"
    buckets[key].append(p.predicted in p.optimal)
print("junctions by their longest side branch (cells):")
for key in ("1-2", "3-5", "6-10", "11+"):
    v = buckets.get(key, [])
    if v:
        print(f"  {key:5s} {sum(v) / len(v):6.1%} of {len(v)} turns")
