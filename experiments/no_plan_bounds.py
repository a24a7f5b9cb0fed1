"""How far maze_2d/easy gets without planning: the bar a trained policy has to clear.

    python experiments/no_plan_bounds.py [MAZES]

Two policies that never look past their neighbours, on the 64 fixed eval mazes (and on
MAZES more seeds, default 2000):
- greedy: the open move that most shortens the straight-line (Manhattan) distance to the
  goal, first in VisGym's action order on ties. Its agreement with the solver on the
  solver's own path, overall and at junctions (three or more open neighbours), is what
  `state_accuracy.py` reports for a policy, so the two compare directly.
- depth-first greedy: greedy among the cells it has not visited yet, stepping back when
  none is left (perfect memory of where it has been, no plan): the mazes it solves within
  the 32-turn budget (31 moves and a stop) bound what exploring without a plan can reach.
"""

from __future__ import annotations

import sys

import numpy as np

from clew.data.rows import generate_rows
from clew.envs import make
from clew.envs.maze.generate import DIRECTIONS, Cell, Maze, generate_maze
from clew.envs.maze.solver import distances_to, next_move

BUDGET = 31  # moves: 32 turns, one of them the stop


def greedy_move(maze: Maze, cell: Cell, avoid: set[Cell] = frozenset()) -> int | None:
    """The open move (not into ``avoid``) that lands closest to the goal in a straight line."""
    r, c = cell
    gr, gc = maze.goal
    moves = [
        d
        for d, (dr, dc) in enumerate(DIRECTIONS)
        if maze.is_open((r + dr, c + dc)) and (r + dr, c + dc) not in avoid
    ]
    if not moves:
        return None
    return min(moves, key=lambda d: abs(r + DIRECTIONS[d][0] - gr) + abs(c + DIRECTIONS[d][1] - gc))


def solver_path_agreement(maze: Maze) -> list[tuple[bool, bool]]:
    """(greedy agrees with the solver, the cell is a junction) for each cell of the path."""
    dist = distances_to(maze, maze.goal)
    out, cell = [], maze.start
    while cell != maze.goal:
        r, c = cell
        exits = sum(maze.is_open((r + dr, c + dc)) for dr, dc in DIRECTIONS)
        best = next_move(maze, dist, cell)
        out.append((greedy_move(maze, cell) == best, exits >= 3))
        cell = (r + DIRECTIONS[best][0], c + DIRECTIONS[best][1])
    return out


def depth_first_moves(maze: Maze, limit: int = 10_000) -> int:
    """Moves the depth-first greedy walker takes to reach the goal (at most ``limit``)."""
    cell, stack, seen, moves = maze.start, [maze.start], {maze.start}, 0
    while cell != maze.goal and moves < limit:
        d = greedy_move(maze, cell, avoid=seen)
        if d is None:
            stack.pop()
            cell = stack[-1]
        else:
            cell = (cell[0] + DIRECTIONS[d][0], cell[1] + DIRECTIONS[d][1])
            stack.append(cell)
            seen.add(cell)
        moves += 1
    return moves


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    evals = []
    for row in generate_rows("maze_2d/easy", 64, "eval"):
        env = make(row.env_id, **row.options())
        env.reset(int(row.seed))
        evals.append(env.maze)
    turns = [t for maze in evals for t in solver_path_agreement(maze)]
    junction = [ok for ok, j in turns if j]
    print(
        f"greedy on the solver's path of the 64 eval mazes: all {np.mean([ok for ok, _ in turns]):.1%} "
        f"of {len(turns)} turns, junction {np.mean(junction):.1%} of {len(junction)}"
    )
    for name, mazes in (("64 eval mazes", evals), (f"{n} mazes (seeds 0..)", None)):
        mazes = mazes or [generate_maze(9, s) for s in range(n)]
        moves = np.array([depth_first_moves(m) for m in mazes])
        print(
            f"depth-first greedy, {name}: solved within {BUDGET} moves {np.mean(moves <= BUDGET):.1%}; "
            f"moves to the goal mean {moves.mean():.1f}, 95th percentile {np.percentile(moves, 95):.0f}, "
            f"max {moves.max()}"
        )


if __name__ == "__main__":
    main()
