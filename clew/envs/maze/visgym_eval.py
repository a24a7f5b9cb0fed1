"""VisGym's ``maze_2d/easy`` mazes of seeds 0-63, as recorded from VisGym's own code.

The SkyRL + VisGym walkthrough evaluates on these 64 mazes (its eval rows carry seeds
0-63 and its env calls ``reset(seed=i)`` on VisGym's ``maze_2d/easy``). clew's own
generator follows the same law (Wilson's algorithm on a 4x4 room grid, start and goal on
opposite corners) but draws from a different random stream, so its seeds 0-63 are other
mazes; ``data/visgym_easy_eval.json`` holds VisGym's, written by
``data/record_visgym_easy_eval.py`` (its header names the repository, commit and date).

The env option ``layout=visgym_easy_eval`` (``grid_size`` 9) plays recorded maze i for
seed i; any other seed is an error. Every such maze is an eval row (``dataset.py``), so

    clew dataset --env-id maze_2d/easy --split eval --option layout=visgym_easy_eval \\
        --option max_turns=15 --output-dir data/visgym

writes exactly the 64 rows, seeds 0-63. ``python -m clew.envs.maze.visgym_eval`` prints
how many of them VisGym's solver finishes within each turn budget (moves plus the stop).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from clew.envs.maze.generate import Cell, Maze
from clew.errors import EnvError

LAYOUT = "visgym_easy_eval"
GRID_SIZE = 9
DATA_FILE = "visgym_easy_eval.json"
DEFAULT_BUDGETS: tuple[int, ...] = (12, 13, 15, 16, 17, 20)


@dataclass(frozen=True)
class RecordedMaze:
    """One recorded maze: its seed, the layout, and VisGym's solver's moves for it."""

    seed: int
    maze: Maze
    solver_moves: tuple[int, ...]
    turns_needed: int  # the solver's moves plus the stop


@dataclass(frozen=True)
class RecordedSet:
    """The data file: where the mazes came from (``source``, ``recorded``) and the mazes,
    maze i at index i."""

    source: dict[str, Any]
    recorded: str
    script: str
    mazes: tuple[RecordedMaze, ...]

    @property
    def seeds(self) -> range:
        return range(len(self.mazes))


def _cell(value: Any, what: str) -> Cell:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)):
        raise ValueError(f"{what} must be [row, col], got {value!r}")
    return (value[0], value[1])


def _maze_of(record: dict[str, Any], index: int) -> RecordedMaze:
    if record.get("seed") != index:
        raise ValueError(f"maze {index} carries seed {record.get('seed')!r}")
    rows = record["maze_map"]
    if len(rows) != GRID_SIZE or any(len(r) != GRID_SIZE or set(r) - {"0", "1"} for r in rows):
        raise ValueError(f"maze {index}: maze_map must be {GRID_SIZE} strings of {GRID_SIZE} 0/1")
    walls = np.array([[ch == "1" for ch in r] for r in rows], dtype=bool)
    maze = Maze(
        walls=walls, start=_cell(record["start"], "start"), goal=_cell(record["target"], "target")
    )
    if not (maze.is_open(maze.start) and maze.is_open(maze.goal)):
        raise ValueError(f"maze {index}: start or target is a wall")
    moves = tuple(int(m) for m in record["solver_moves"])
    if record["turns_needed"] != len(moves) + 1:
        raise ValueError(f"maze {index}: turns_needed is not the solver's moves + 1")
    return RecordedMaze(index, maze, moves, int(record["turns_needed"]))


def parse_recorded_set(document: dict[str, Any]) -> RecordedSet:
    """The recorded set of a parsed data file; ValueError names what is malformed."""
    try:
        mazes = tuple(_maze_of(m, i) for i, m in enumerate(document["mazes"]))
        return RecordedSet(
            source=dict(document["source"]),
            recorded=str(document["recorded"]),
            script=str(document["script"]),
            mazes=mazes,
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a recorded maze set: missing or malformed {exc}") from None


@cache
def recorded_set() -> RecordedSet:
    """The packaged data file, parsed once per process."""
    text = resources.files("clew.envs.maze").joinpath("data", DATA_FILE).read_text()
    return parse_recorded_set(json.loads(text))


def recorded_maze(size: int, seed: int) -> Maze:
    """Recorded maze ``seed`` (0-63) of VisGym's 9x9 ``maze_2d/easy``."""
    mazes = recorded_set().mazes
    if size != GRID_SIZE:
        raise EnvError(
            f"layout {LAYOUT} holds VisGym's {GRID_SIZE}x{GRID_SIZE} maze_2d/easy mazes; "
            f"grid_size must be {GRID_SIZE}, got {size}"
        )
    if (
        isinstance(seed, bool)
        or not isinstance(seed, int | np.integer)
        or not 0 <= seed < len(mazes)
    ):
        raise EnvError(
            f"layout {LAYOUT} has the {len(mazes)} mazes of seeds 0-{len(mazes) - 1} (VisGym's "
            f"maze_2d/easy eval seeds); seed {seed!r} is not one of them. Rows of exactly "
            "those: clew dataset --split eval --option layout=visgym_easy_eval"
        )
    return mazes[int(seed)].maze


def ceiling_table(budgets: tuple[int, ...] = DEFAULT_BUDGETS) -> list[tuple[int, int, float]]:
    """``(max_turns, solvable, share)`` per budget: how many recorded mazes VisGym's solver
    finishes (its moves and the stop) within ``max_turns``, the ceiling of any solve rate
    on them at that budget."""
    needed = [m.turns_needed for m in recorded_set().mazes]
    out = []
    for budget in budgets:
        if budget < 1:
            raise ValueError(f"a turn budget must be a positive integer, got {budget}")
        solvable = sum(n <= budget for n in needed)
        out.append((budget, solvable, solvable / len(needed)))
    return out


def format_ceiling_table(budgets: tuple[int, ...] = DEFAULT_BUDGETS) -> str:
    """``ceiling_table`` as a Markdown table, with the histogram of turns needed above it."""
    mazes = recorded_set().mazes
    counts: dict[int, int] = {}
    for m in mazes:
        counts[m.turns_needed] = counts.get(m.turns_needed, 0) + 1
    hist = ", ".join(f"{n} turns: {c}" for n, c in sorted(counts.items()))
    lines = [
        f"{len(mazes)} mazes; turns needed (solver's moves + stop): {hist}",
        "",
        "| max_turns | solvable | ceiling |",
        "| ---: | ---: | ---: |",
    ]
    lines += [
        f"| {b} | {s} / {len(mazes)} | {share:.1%} |" for b, s, share in ceiling_table(budgets)
    ]
    return "\n".join(lines)


def compare_with_clew() -> str:
    """How clew's own ``maze_2d/easy`` generator's seeds 0-63 relate to the recorded mazes:
    how many are the same maze, and the turns its solver needs on each set."""
    from clew.envs.maze.generate import generate_maze
    from clew.envs.maze.solver import shortest_actions

    mazes = recorded_set().mazes
    ours = [generate_maze(GRID_SIZE, m.seed) for m in mazes]
    same_walls = sum(
        np.array_equal(o.walls, m.maze.walls) for o, m in zip(ours, mazes, strict=True)
    )
    same = sum(o.layout_key() == m.maze.layout_key() for o, m in zip(ours, mazes, strict=True))

    def histogram(turns: list[int]) -> str:
        return ", ".join(f"{n} turns: {turns.count(n)}" for n in sorted(set(turns)))

    return "\n".join(
        [
            f"clew's seeds 0-{len(mazes) - 1}: {same_walls} have VisGym's walls of the same "
            f"seed, {same} the same walls, start and goal",
            f"turns needed, VisGym's: {histogram([m.turns_needed for m in mazes])}",
            f"turns needed, clew's:   {histogram([len(shortest_actions(o)) + 1 for o in ours])}",
        ]
    )


def train_overlap(num_seeds: int) -> list[int]:
    """clew's ``maze_2d/easy`` seeds below ``num_seeds`` whose maze falls in the train split
    (by layout digest) and is one of the recorded mazes: training rows that would also be
    walkthrough eval mazes (Wilson's law gives each of the ~400k layouts equal odds)."""
    from clew.envs.maze.dataset import split_of_layout
    from clew.envs.maze.generate import generate_maze

    keys = {m.maze.layout_key() for m in recorded_set().mazes}
    hits = []
    for seed in range(num_seeds):
        key = generate_maze(GRID_SIZE, seed).layout_key()
        if key in keys and split_of_layout(key) == "train":
            hits.append(seed)
    return hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m clew.envs.maze.visgym_eval",
        description="How many of VisGym's 64 maze_2d/easy eval mazes each turn budget can solve.",
    )
    parser.add_argument(
        "budgets",
        nargs="*",
        type=int,
        default=list(DEFAULT_BUDGETS),
        help="turn budgets (max_turns), default: " + " ".join(map(str, DEFAULT_BUDGETS)),
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also compare with clew's own generator's seeds 0-63",
    )
    parser.add_argument(
        "--overlap",
        type=int,
        default=0,
        metavar="N",
        help="also list clew's train seeds below N whose maze is one of the recorded ones",
    )
    args = parser.parse_args(argv)
    if any(b < 1 for b in args.budgets):
        parser.error("turn budgets must be positive integers")
    data = recorded_set()
    print(f"source: {data.source['repository']} @ {data.source['commit']} ({data.recorded})")
    print(format_ceiling_table(tuple(args.budgets)))
    if args.compare:
        print()
        print(compare_with_clew())
    if args.overlap > 0:
        hits = train_overlap(args.overlap)
        print()
        print(
            f"clew's train seeds below {args.overlap} whose maze is one of the recorded: "
            f"{len(hits)}" + (f" (seeds {', '.join(map(str, hits))})" if hits else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
