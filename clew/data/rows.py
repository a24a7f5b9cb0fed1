"""Dataset rows: one episode of a registered env per row, written to and read from parquet.

A ``Row`` is generic: the env id and its resolved options, the seed, the split, the first
prompt, the turn budget, and free ``metadata`` of env-specific facts. Every row carries its
seed, so all samples of a GRPO group play the same episode. Options and metadata are
stored as JSON strings so a row is self-contained (the env is rebuilt from the row alone,
even if a default changes later).

``generate_rows`` works for any registered env. It walks seeds from the split's first seed
and asks the env's dataset hooks (``clew.envs.DatasetHooks.row_facts``) which split each
seed's episode belongs to, what makes it a distinct task and what to record; an env
without hooks gives every seed of the walk. Where the env has an expert, each row also
records ``turns_needed`` (the expert's turns from the start) and ``solvable`` (they fit in
the turn budget), whatever the env. The maze registers hooks that split by layout digest,
so train and eval never share a maze, and record the path length and the digest. Rows
given as ``exclude`` keep their tasks out of the new set: a held-out set drawn beside an
eval set repeats none of its tasks.

An env whose options give tasks for a fixed range of seeds only (a recorded set, such as
the maze's ``layout=visgym_easy_eval``: VisGym's 64 eval mazes) says so through a
``seeds(env)`` hook beside its dataset hooks; the walk then starts at the range's first
seed and never leaves it, and ``task_seeds`` tells ``clew dataset`` how many rows it holds.

Files written before rows were generic held the maze's facts as columns
(``optimal_path_length``, ``turns_needed``, ``solvable``, ``layout_key``); ``read_rows``
reads them into metadata, so those datasets keep working.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from clew.envs import DatasetHooks, RowFacts, make, spec
from clew.errors import DataError

SPLITS = ("train", "eval")
DEFAULT_SEED_START = {"train": 0, "eval": 1_000_000_000}
# Columns of the maze-only rows that came before ``metadata``; read into it.
LEGACY_COLUMNS = ("optimal_path_length", "turns_needed", "solvable", "layout_key")


def _json(value: str | dict[str, Any]) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


@dataclass(frozen=True)
class Row:
    """One dataset row: which env, which seed, and what the env said about the episode.

    ``env_options`` and ``metadata`` are JSON objects; a dict given for either is stored as
    its JSON text (sorted keys), so rows stay hashable and compare by content.
    """

    env_id: str
    env_options: str  # JSON object of the resolved env options
    seed: int
    split: str
    prompt: str
    max_turns: int
    metadata: str = "{}"  # JSON object of env-specific facts (see the module docstring)

    def __post_init__(self) -> None:
        object.__setattr__(self, "env_options", _json(self.env_options))
        object.__setattr__(self, "metadata", _json(self.metadata))

    def options(self) -> dict[str, Any]:
        return json.loads(self.env_options)

    def facts(self) -> dict[str, Any]:
        """The metadata as a dict."""
        return json.loads(self.metadata)

    @property
    def turns_needed(self) -> int | None:
        """Turns the expert's play takes from the start; None where the row does not say."""
        needed = self.facts().get("turns_needed")
        return None if needed is None else int(needed)

    @property
    def solvable(self) -> bool:
        """Whether the expert finishes within the turn budget (True where the row does not
        say: an env without an expert makes no claim)."""
        return bool(self.facts().get("solvable", True))

    def solvable_within(self, max_turns: int) -> bool:
        """Whether the expert finishes within ``max_turns`` and the row's own budget."""
        needed = self.turns_needed
        if needed is None:
            return self.solvable
        return needed <= min(self.max_turns, max_turns)


def generate_rows(
    env_id: str,
    num_rows: int,
    split: str = "train",
    seed_start: int | None = None,
    env_options: dict[str, Any] | None = None,
    distinct: bool | None = None,
    exclude: Sequence[Row] = (),
) -> list[Row]:
    """``num_rows`` rows of ``split``, from consecutive seeds whose episodes fall in it.

    ``distinct`` (default: True for eval, False for train) skips seeds whose task (the
    key of the env's ``row_facts``) is already in the set, so an eval set of N rows is N
    different tasks. ``exclude``: rows whose tasks the new rows must not repeat (a
    held-out set beside an eval set); seeds of those tasks are skipped.
    """
    distinct = split == "eval" if distinct is None else distinct
    if split not in SPLITS:
        raise DataError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not isinstance(num_rows, int) or num_rows <= 0:
        raise DataError(f"the number of rows must be a positive integer, got {num_rows!r}")
    env_spec = spec(env_id)
    options = env_spec.resolve_options(dict(env_options or {}))
    options_json = json.dumps(options, sort_keys=True)
    env = make(env_id, **options)
    row_facts = env_spec.dataset.row_facts
    expert = env_spec.expert
    fixed = _fixed_seeds(env_spec, env)
    first = DEFAULT_SEED_START[split] if fixed is None else fixed.start
    seed = first if seed_start is None else int(seed_start)
    excluded = task_keys(exclude)
    seen: set[str] = set()
    rows: list[Row] = []
    tried = 0
    while len(rows) < num_rows:
        if fixed is not None and seed not in fixed:
            raise DataError(
                f"{env_id} with options {options_json} has tasks for seeds "
                f"{fixed.start}-{fixed.stop - 1} only; of those from seed "
                f"{first if seed_start is None else seed_start} on, {len(rows)} are {split} "
                f"rows, fewer than the {num_rows} asked"
            )
        obs = env.reset(seed)
        facts = row_facts(env) if row_facts is not None else RowFacts()
        key = _task_key(facts, seed)
        new = key not in excluded and not (distinct and key in seen)
        if facts.split in (None, split) and new:
            seen.add(key)
            metadata = dict(facts.metadata)
            if expert is not None:
                needed = expert.turns_to_finish(env)
                metadata["turns_needed"] = needed
                metadata["solvable"] = needed is not None and needed <= env.max_turns
            rows.append(Row(env_id, options_json, seed, split, obs.text, env.max_turns, metadata))
        seed += 1
        tried += 1
        if tried > 100 * num_rows + 10_000:
            raise DataError(
                f"found only {len(rows)} {split} rows of {env_id} in {tried} seeds: it has too "
                "few distinct tasks for a split of this size (a larger size of the task may "
                "have more)"
            )
    return rows


def task_keys(rows: Sequence[Row]) -> set[str]:
    """The tasks of ``rows``: the key the env's ``row_facts`` gives each row's episode (its
    seed, as text, where the env gives none), from an env of the row's own id and options
    reset at its seed."""
    envs: dict[tuple[str, str], Any] = {}
    keys: set[str] = set()
    for row in rows:
        env = envs.get((row.env_id, row.env_options))
        if env is None:
            env = envs[(row.env_id, row.env_options)] = make(row.env_id, **row.options())
        env.reset(row.seed)
        row_facts = spec(row.env_id).dataset.row_facts
        keys.add(_task_key(row_facts(env) if row_facts is not None else RowFacts(), row.seed))
    return keys


def _task_key(facts: RowFacts, seed: int) -> str:
    """A seed's task: the key its ``row_facts`` give, else the seed itself."""
    return str(seed) if facts.key is None else facts.key


def _fixed_seeds(env_spec: Any, env: Any) -> range | None:
    """The seeds ``env`` (as its options made it) has tasks for, when they are a fixed
    range (the env's ``seeds`` dataset hook); None when every seed has one."""
    seeds = getattr(env_spec.dataset, "seeds", None)
    return None if seeds is None else seeds(env)


def task_seeds(env_id: str, env_options: dict[str, Any] | None = None) -> range | None:
    """The fixed range of seeds ``env_id`` with ``env_options`` has tasks for (a recorded
    set), or None when every seed has a task."""
    env_spec = spec(env_id)
    options = env_spec.resolve_options(dict(env_options or {}))
    return _fixed_seeds(env_spec, make(env_id, **options))


def write_rows(rows: list[Row], path: str | os.PathLike) -> Path:
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


def read_rows(path: str | os.PathLike) -> list[Row]:
    """Rows of a parquet file written by ``write_rows`` (or by clew before rows were
    generic); clear errors for other files."""
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


def _rows_of(table: pa.Table, path: object) -> list[Row]:
    columns = set(table.column_names)
    fields = list(Row.__dataclass_fields__)
    legacy = "metadata" not in columns and columns.issuperset(LEGACY_COLUMNS)
    expected = set(fields) - {"metadata"} if legacy else set(fields)
    missing = expected - columns
    if missing:
        raise DataError(
            f"{path} lacks the column(s) {', '.join(sorted(missing))} of a clew dataset "
            f"(expected {', '.join(fields)})"
        )
    out = []
    for r in table.to_pylist():
        values = {k: r[k] for k in expected}
        if legacy:
            values["metadata"] = {k: r[k] for k in LEGACY_COLUMNS}
        try:
            out.append(Row(**values))
        except (TypeError, ValueError) as exc:
            raise DataError(f"{path} holds a row that is not a clew row: {exc}") from None
    return out


def dataset_stats(rows: list[Row]) -> dict[str, Any]:
    """How many rows, the share the expert solves within the turn budget (None where no
    row says), and the env's own statistics (its ``DatasetHooks.stats``) where all rows
    are of envs that share them."""
    n = len(rows)
    known = [r for r in rows if "solvable" in r.facts()]
    stats: dict[str, Any] = {
        "rows": n,
        "env_ids": sorted({r.env_id for r in rows}),
        "solvable_share": sum(r.solvable for r in known) / len(known) if known else None,
    }
    hooks = _shared_hooks(stats["env_ids"])
    if hooks is not None and hooks.stats is not None:
        stats |= hooks.stats(rows)
    return stats


def _shared_hooks(env_ids: list[str]) -> DatasetHooks | None:
    """The dataset hooks every one of ``env_ids`` is registered with, if they share them."""
    hooks = {id(h): h for h in (spec(i).dataset for i in env_ids)}
    return next(iter(hooks.values())) if len(hooks) == 1 else None


def format_stats(stats: dict[str, Any]) -> str:
    """``dataset_stats`` as lines to print."""
    envs = ", ".join(stats["env_ids"]) or "no env"
    share = stats["solvable_share"]
    lines = [
        f"rows: {stats['rows']} of {envs}",
        (
            f"solvable within the turn budget: {share:.1%} (the ceiling of any solve rate on "
            "these rows)"
            if share is not None
            else "solvable within the turn budget: not known (the env has no expert)"
        ),
    ]
    hooks = _shared_hooks(stats["env_ids"])
    if hooks is not None and hooks.describe is not None and hooks.stats is not None:
        lines += hooks.describe(stats)
    return "\n".join(lines)


def with_env_option(rows: list[Row], key: str, value: Any) -> list[Row]:
    """``rows`` with the env option ``key`` set to ``value`` (a run's override of what the
    rows were made with, e.g. ``environment.prompt_format``); each env must accept it."""
    out, checked = [], set()
    for row in rows:
        if key not in spec(row.env_id).accepted_options:
            raise DataError(
                f"environment {row.env_id!r} has no option {key!r}, so it cannot be set for "
                "its rows"
            )
        options = {**row.options(), key: value}
        if row.env_id not in checked:  # a value the env refuses fails here, not per episode
            make(row.env_id, **options)
            checked.add(row.env_id)
        out.append(dataclasses.replace(row, env_options=options))
    return out
