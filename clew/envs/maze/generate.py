"""Maze layouts: perfect mazes carved with Wilson's algorithm.

A layout is an odd ``size x size`` grid of walls (True) and floor (False) with a wall
ring. Rooms sit at odd coordinates and a passage opens between two rooms when the spanning
tree links them, so the open cells form a tree: exactly one path joins any two of them.
Wilson's loop-erased random walk samples that tree uniformly among all spanning trees,
which keeps the maze distribution unbiased (a DFS backtracker favours long corridors).
Start and goal sit at opposite interior corners, the pair and the direction chosen by the
seed. Everything draws from ``numpy.random.default_rng(seed)``, so a seed gives the same
maze in every process and on every platform.

VisGym follows the same law but draws from other random streams, so clew's seed i is not
VisGym's maze i; the layout ``visgym_easy_eval`` plays VisGym's own recorded mazes of seeds
0-63 (``clew.envs.maze.visgym_eval``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

Cell = tuple[int, int]

# Action ids follow VisGym: 0 right, 1 up, 2 left, 3 down; (row, col) offsets.
DIRECTIONS: tuple[Cell, ...] = ((0, 1), (-1, 0), (0, -1), (1, 0))
DIRECTION_NAMES: tuple[str, ...] = ("right", "up", "left", "down")


@dataclass(frozen=True)
class Maze:
    """A maze layout: ``walls[r, c]`` is True for a wall; start and goal are open cells."""

    walls: np.ndarray
    start: Cell
    goal: Cell

    @property
    def size(self) -> int:
        return int(self.walls.shape[0])

    def is_open(self, cell: Cell) -> bool:
        r, c = cell
        return 0 <= r < self.size and 0 <= c < self.size and not self.walls[r, c]

    def layout_key(self) -> str:
        """A digest of walls, start and goal: equal keys mean the same maze to play."""
        h = hashlib.sha256()
        h.update(np.packbits(self.walls).tobytes())
        h.update(bytes([self.size, *self.start, *self.goal]))
        return h.hexdigest()


def check_size(size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 5 or size % 2 == 0:
        raise ValueError(f"grid size must be an odd integer >= 5, got {size!r}")


def generate_maze(size: int, seed: int) -> Maze:
    """The perfect maze of ``size`` (odd, >= 5, wall ring included) for ``seed``."""
    check_size(size)
    rng = np.random.default_rng(seed)
    rooms_per_side = (size - 1) // 2
    walls = np.ones((size, size), dtype=bool)
    n_rooms = rooms_per_side * rooms_per_side
    in_tree = np.zeros(n_rooms, dtype=bool)
    in_tree[int(rng.integers(n_rooms))] = True
    # Room i sits at grid cell (2*(i // k) + 1, 2*(i % k) + 1).
    k = rooms_per_side
    for r in range(k):
        for c in range(k):
            walls[2 * r + 1, 2 * c + 1] = False
    next_room = np.full(n_rooms, -1, dtype=np.int64)
    for start_room in rng.permutation(n_rooms):
        if in_tree[start_room]:
            continue
        # Random walk until the tree is hit, remembering only the last exit of each room:
        # overwriting the exit is what erases the loops.
        room = int(start_room)
        while not in_tree[room]:
            r, c = divmod(room, k)
            options = [
                (r + dr) * k + (c + dc)
                for dr, dc in DIRECTIONS
                if 0 <= r + dr < k and 0 <= c + dc < k
            ]
            nxt = options[int(rng.integers(len(options)))]
            next_room[room] = nxt
            room = nxt
        room = int(start_room)
        while not in_tree[room]:
            nxt = int(next_room[room])
            (r0, c0), (r1, c1) = divmod(room, k), divmod(nxt, k)
            walls[r0 + r1 + 1, c0 + c1 + 1] = False  # the passage between the two rooms
            in_tree[room] = True
            room = nxt
    lo, hi = 1, size - 2
    corners: list[tuple[Cell, Cell]] = [((lo, lo), (hi, hi)), ((lo, hi), (hi, lo))]
    a, b = corners[int(rng.integers(2))]
    if rng.integers(2):
        a, b = b, a
    return Maze(walls=walls, start=a, goal=b)


# "visgym_easy_eval": VisGym's own maze_2d/easy mazes of seeds 0-63, recorded
# (clew.envs.maze.visgym_eval); the other seeds have no maze.
LAYOUTS = ("maze", "room", "visgym_easy_eval")


def generate_room(size: int, seed: int) -> Maze:
    """An open room: the wall ring only, start and goal on distinct interior cells.

    The navigation skill without the planning: the agent must find itself and the goal in
    the picture and walk toward it. clew's CPU main job trains on it (see the README).
    """
    check_size(size)
    rng = np.random.default_rng(seed)
    walls = np.ones((size, size), dtype=bool)
    walls[1:-1, 1:-1] = False
    inner = size - 2
    a, b = rng.choice(inner * inner, size=2, replace=False)
    start = (int(a // inner) + 1, int(a % inner) + 1)
    goal = (int(b // inner) + 1, int(b % inner) + 1)
    return Maze(walls=walls, start=start, goal=goal)


def generate_layout(layout: str, size: int, seed: int) -> Maze:
    """The maze of ``seed`` under ``layout`` (one of ``LAYOUTS``)."""
    if layout == "maze":
        return generate_maze(size, seed)
    if layout == "room":
        return generate_room(size, seed)
    if layout == "visgym_easy_eval":
        from clew.envs.maze.visgym_eval import recorded_maze

        return recorded_maze(size, seed)
    raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def layout_seeds(layout: str) -> range | None:
    """The seeds ``layout`` has a maze for: a range for a recorded set, None for any seed."""
    if layout == "visgym_easy_eval":
        from clew.envs.maze.visgym_eval import recorded_set

        return recorded_set().seeds
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    return None
