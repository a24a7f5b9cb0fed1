"""Breadth-first search over maze cells: shortest paths and the actions that follow them."""

from __future__ import annotations

from collections import deque

import numpy as np

from clew.envs.maze.generate import DIRECTIONS, Cell, Maze


def distances_to(maze: Maze, target: Cell) -> np.ndarray:
    """Moves from every cell to ``target`` (-1 where unreachable or a wall)."""
    dist = np.full(maze.walls.shape, -1, dtype=np.int32)
    dist[target] = 0
    queue = deque([target])
    while queue:
        r, c = queue.popleft()
        for dr, dc in DIRECTIONS:
            n = (r + dr, c + dc)
            if maze.is_open(n) and dist[n] < 0:
                dist[n] = dist[r, c] + 1
                queue.append(n)
    return dist


def shortest_actions(maze: Maze, start: Cell | None = None, goal: Cell | None = None) -> list[int]:
    """The direction ids of a shortest path from ``start`` to ``goal`` (no final stop)."""
    start = maze.start if start is None else start
    goal = maze.goal if goal is None else goal
    dist = distances_to(maze, goal)
    if dist[start] < 0:
        raise ValueError(f"no path from {start} to {goal}")
    actions: list[int] = []
    cell = start
    while cell != goal:
        d = next_move(maze, dist, cell)
        actions.append(d)
        cell = (cell[0] + DIRECTIONS[d][0], cell[1] + DIRECTIONS[d][1])
    return actions


def next_move(maze: Maze, dist: np.ndarray, cell: Cell) -> int | None:
    """The first direction id (VisGym's order) from ``cell`` one move closer on ``dist``
    (``distances_to`` the goal); None on the goal or where no move is closer."""
    for d, (dr, dc) in enumerate(DIRECTIONS):
        n = (cell[0] + dr, cell[1] + dc)
        if maze.is_open(n) and dist[n] == dist[cell] - 1:
            return d
    return None
