"""Dataset rows: one maze per row, written to and read from parquet.

Every row carries its seed, so all samples of a GRPO group play the same maze. Train and
eval rows never share a maze: each layout (walls, start, goal) falls in exactly one split
by a digest of the layout itself, so the two sets stay disjoint whatever seed ranges or
row counts are asked for. Options are stored as a JSON string so a row is self-contained
(the env is rebuilt from the row alone, even if a default changes later).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from clew.envs import make, spec
from clew.errors import DataError

SPLITS = ("train", "eval")
EVAL_BUCKETS = 8  # one layout in eight belongs to eval
DEFAULT_SEED_START = {"train": 0, "eval": 1_000_000_000}


@dataclass(frozen=True)
class MazeRow:
    """One dataset row: the env id and options, the seed, and facts about its maze."""

    env_id: str
    env_options: str  # JSON object of the resolved env options
    seed: int
    split: str
    prompt: str
    optimal_path_length: int
    turns_needed: int
    max_turns: int
    solvable: bool  # the optimal play fits in the turn budget
    layout_key: str

    def options(self) -> dict[str, Any]:
        return json.loads(self.env_options)


def split_of_layout(layout_key: str) -> str:
    return "eval" if int(layout_key[:8], 16) % EVAL_BUCKETS == 0 else "train"


def generate_rows(
    env_id: str,
    num_rows: int,
    split: str = "train",
    seed_start: int | None = None,
    env_options: dict[str, Any] | None = None,
    distinct: bool | None = None,
) -> list[MazeRow]:
    """``num_rows`` rows of ``split``, from consecutive seeds whose layouts fall in it.

    ``distinct`` (default: True for eval, False for train) skips seeds whose layout is
    already in the set, so an eval set of N rows is N different mazes.
    """
    distinct = split == "eval" if distinct is None else distinct
    seen: set[str] = set()
    if split not in SPLITS:
        raise DataError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not isinstance(num_rows, int) or num_rows <= 0:
        raise DataError(f"the number of rows must be a positive integer, got {num_rows!r}")
    options = spec(env_id).resolve_options(dict(env_options or {}))
    env = make(env_id, **options)
    seed = DEFAULT_SEED_START[split] if seed_start is None else int(seed_start)
    rows: list[MazeRow] = []
    tried = 0
    while len(rows) < num_rows:
        env.reset(seed)
        key = env.maze.layout_key()
        if split_of_layout(key) == split and not (distinct and key in seen):
            seen.add(key)
            rows.append(
                MazeRow(
                    env_id=env_id,
                    env_options=json.dumps(options, sort_keys=True),
                    seed=seed,
                    split=split,
                    prompt=env.prompt,
                    optimal_path_length=env.optimal_path_length(),
                    turns_needed=env.turns_needed(),
                    max_turns=env.max_turns,
                    solvable=env.turns_needed() <= env.max_turns,
                    layout_key=key,
                )
            )
        seed += 1
        tried += 1
        if tried > 100 * num_rows + 10_000:
            raise DataError(
                f"found only {len(rows)} {split} mazes of {env_id} in {tried} seeds: this size "
                "has too few distinct layouts for a split; use a larger grid_size"
            )
    return rows


def write_rows(rows: list[MazeRow], path: str | os.PathLike) -> Path:
    """Write ``rows`` to a parquet file, creating its folder; clear errors when unwritable."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist([asdict(r) for r in rows])
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise DataError(f"cannot write the dataset to {path}: {exc.strerror or exc}") from None
    return path


def read_rows(path: str | os.PathLike) -> list[MazeRow]:
    """Rows of a parquet file written by ``write_rows``; clear errors for other files."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"dataset file {path} does not exist (expected a .parquet written by `clew dataset`)"
        )
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a non-parquet file
        raise DataError(f"{path} is not a readable parquet file: {exc}") from None
    return _rows_of(table, path)


def _rows_of(table: pa.Table, path: object) -> list[MazeRow]:
    expected = set(MazeRow.__dataclass_fields__)
    missing = expected - set(table.column_names)
    if missing:
        raise DataError(
            f"{path} lacks the column(s) {', '.join(sorted(missing))} of a clew dataset"
        )
    return [MazeRow(**{k: r[k] for k in expected}) for r in table.to_pylist()]


def dataset_stats(rows: list[MazeRow]) -> dict[str, Any]:
    """Distribution of optimal path lengths and the share solvable within the turn budget."""
    lengths = Counter(r.optimal_path_length for r in rows)
    n = len(rows)
    return {
        "rows": n,
        "distinct_mazes": len({r.layout_key for r in rows}),
        "path_length_histogram": dict(sorted(lengths.items())),
        "mean_path_length": sum(r.optimal_path_length for r in rows) / n if n else 0.0,
        "solvable_share": sum(r.solvable for r in rows) / n if n else 0.0,
    }


def format_stats(stats: dict[str, Any]) -> str:
    lines = [
        f"rows: {stats['rows']}  distinct mazes: {stats['distinct_mazes']}",
        f"mean optimal path length: {stats['mean_path_length']:.2f} moves",
        f"solvable within the turn budget: {stats['solvable_share']:.1%} "
        "(the ceiling of any solve rate on these rows)",
        "optimal path length  rows",
    ]
    total = max(stats["rows"], 1)
    for length, count in stats["path_length_histogram"].items():
        bar = "#" * max(1, round(40 * count / total))
        lines.append(f"{length:>19}  {count:>4}  {bar}")
    return "\n".join(lines)
