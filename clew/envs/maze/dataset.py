"""What a dataset row of a maze records, and the statistics ``clew dataset --stats`` prints.

Train and eval rows never share a maze: each layout (walls, start, goal) falls in exactly
one split by a digest of the layout itself, so the two sets stay disjoint whatever seed
ranges or row counts are asked for, and the layout's digest is the key of a set of
distinct mazes. A row keeps the digest and the shortest path's length in its metadata
(the expert adds ``turns_needed`` and ``solvable``, as for any env with one).

A recorded layout (``visgym_easy_eval``: VisGym's own mazes of seeds 0-63) is a fixed eval
set instead: all its mazes are eval rows, and ``seeds`` tells ``clew.data.rows`` that its
seeds are those and no others, so an eval set of it is exactly the recorded mazes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from clew.envs.base import DatasetHooks, RowFacts
from clew.envs.maze.env import MazeEnv
from clew.envs.maze.generate import layout_seeds

EVAL_BUCKETS = 8  # one layout in eight belongs to eval


def split_of_layout(layout_key: str) -> str:
    return "eval" if int(layout_key[:8], 16) % EVAL_BUCKETS == 0 else "train"


def maze_row_facts(env: MazeEnv) -> RowFacts:
    """The split, key and metadata of the maze ``env`` was just reset to."""
    assert env.maze is not None, "call reset() first"
    key = env.maze.layout_key()
    recorded = layout_seeds(env.layout) is not None
    return RowFacts(
        split="eval" if recorded else split_of_layout(key),
        key=key,
        metadata={"optimal_path_length": env.optimal_path_length(), "layout_key": key},
    )


def maze_stats(rows: Sequence[Any]) -> dict[str, Any]:
    """Distinct mazes and the distribution of optimal path lengths."""
    facts = [r.facts() for r in rows]
    lengths = Counter(f["optimal_path_length"] for f in facts)
    n = len(facts)
    return {
        "distinct_mazes": len({f["layout_key"] for f in facts}),
        "path_length_histogram": dict(sorted(lengths.items())),
        "mean_path_length": sum(f["optimal_path_length"] for f in facts) / n if n else 0.0,
    }


def describe_maze_stats(stats: dict[str, Any]) -> list[str]:
    lines = [
        f"distinct mazes: {stats['distinct_mazes']}",
        f"mean optimal path length: {stats['mean_path_length']:.2f} moves",
        "optimal path length  rows",
    ]
    total = max(stats["rows"], 1)
    for length, count in stats["path_length_histogram"].items():
        bar = "#" * max(1, round(40 * count / total))
        lines.append(f"{length:>19}  {count:>4}  {bar}")
    return lines


def maze_seeds(env: MazeEnv) -> range | None:
    """The seeds ``env``'s layout has mazes for (a recorded set's), None for any seed."""
    return layout_seeds(env.layout)


@dataclass(frozen=True)
class MazeDatasetHooks(DatasetHooks):
    """The maze's dataset hooks, with ``seeds(env)``: the only seeds the env's options
    have tasks for (None: every seed), which ``clew.data.rows`` walks instead of the
    split's default seeds."""

    seeds: Callable[[Any], range | None] | None = None


MAZE_DATASET = MazeDatasetHooks(
    row_facts=maze_row_facts, stats=maze_stats, describe=describe_maze_stats, seeds=maze_seeds
)
