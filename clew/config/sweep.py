"""A sweep's grid: the ``key=a,b`` overrides of ``clew train -m``, as Hydra's multirun reads them.

With ``-m`` (``--multirun``) an override whose value is a comma-separated list at top level is
a sweep axis: ``trainer.policy.optimizer_config.lr=1e-4,2e-4`` gives two runs. A list in
brackets (``data.train_data=[a.parquet,b.parquet]``) or a quoted string (``key='a,b'``) is one
value, as in Hydra; ``key=[a],[b,c]`` sweeps two lists. The runs are the cartesian product of
the axes in the order they were given, the last axis varying fastest (Hydra's order).

Each combination has a name, its run folder under the sweep's: ``<short key>=<value>`` per
axis, joined by ``,`` (``lr=1e-4,rank=32``). The short key is the shortest tail of the dotted
key that no other axis shares (``lr``; ``policy.optimizer_config.lr`` beside
``sft.optimizer_config.lr``), the value is the text as written, quotes off, with each run
of characters other than letters, digits and ``._+-`` made one ``_``, none at either end
(``[a.parquet,b.parquet]``: ``a.parquet_b.parquet``). Two values of one axis that become the
same text keep it apart by a hash of what was written; a name over 120 characters is cut,
with a hash of the whole.

Nothing here reads the schema beyond the keys' spelling: each value is parsed and checked
where every override is (``clew.config.overrides``), once per combination.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass

from clew.config.keys import canonical_key
from clew.config.overrides import _is_quoted, _split_top, _unquote
from clew.errors import ConfigError

# The keys that place the sweep itself: its folder is trainer.log_path/trainer.run_name.
UNSWEPT_KEYS = ("trainer.log_path", "trainer.run_name")
MAX_NAME = 120
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


@dataclass(frozen=True)
class Axis:
    """One swept key: its canonical ``key``, the spelling it was ``written`` with, and its
    ``values`` as written (each a value text an override takes)."""

    key: str
    written: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class Combination:
    """One run of the sweep: its folder ``name``, the overrides that make it (the fixed ones,
    then one per axis, in the command's order) and the axes' values by key."""

    name: str
    overrides: tuple[str, ...]
    values: dict[str, str]


@dataclass(frozen=True)
class Grid:
    """The overrides of a ``-m`` command line: ``fixed`` ones in order, and the ``axes``."""

    fixed: tuple[str, ...]
    axes: tuple[Axis, ...]

    def combinations(self) -> list[Combination]:
        """Every combination of the axes' values, the last axis varying fastest; one with no
        axis-overrides when there are no axes, named ``run``."""
        shorts = short_keys([a.key for a in self.axes])
        slugs = [value_slugs(a.values) for a in self.axes]
        out = []
        for picks in itertools.product(*(range(len(a.values)) for a in self.axes)):
            chosen = list(zip(self.axes, shorts, slugs, picks, strict=True))
            name = ",".join(f"{short}={slug[i]}" for _, short, slug, i in chosen)
            out.append(
                Combination(
                    name=_bounded(name or "run"),
                    overrides=(*self.fixed, *(f"{a.written}={a.values[i]}" for a, *_, i in chosen)),
                    values={a.key: a.values[i] for a, *_, i in chosen},
                )
            )
        return out


def _key_of(override: str) -> str | None:
    raw_key, sep, _ = override.partition("=")
    written = raw_key.strip().lstrip("+")
    return canonical_key(written) if sep and written else None


def sweep_values(text: str) -> tuple[str, ...] | None:
    """The values of a sweep value text (``1e-4,2e-4``), stripped, or None when ``text`` is one
    value: no comma outside brackets and quotes, or unbalanced (left to the override's parser
    to report). An empty value in a list (``a,,b``, ``a,``) is a ``ConfigError``."""
    try:
        parts = _split_top(text, ",")
    except ValueError:
        return None
    if len(parts) < 2:
        return None
    values = tuple(p.strip() for p in parts)
    if not all(values):
        raise ConfigError(f"sweep value {text!r} has an empty value between its commas")
    return values


def parse_grid(overrides: list[str] | tuple[str, ...]) -> Grid:
    """Split a ``-m`` command line's overrides into fixed ones and sweep axes.

    Raises ``ConfigError`` for a swept key given twice or set again by another override, a
    value given twice within an axis, an empty value, or a swept ``trainer.log_path`` or
    ``trainer.run_name`` (they place the sweep's folder).
    """
    fixed: list[str] = []
    axes: list[Axis] = []
    for override in overrides:
        key = _key_of(override)
        raw_key, _, text = override.partition("=")
        values = sweep_values(text) if key is not None else None
        if values is None:
            fixed.append(override)
            continue
        if key in UNSWEPT_KEYS:
            raise ConfigError(
                f"{key} cannot be swept: the sweep's folder is trainer.log_path/"
                "trainer.run_name, and each run's folder lies inside it"
            )
        if len(set(values)) != len(values):
            twice = sorted({v for v in values if values.count(v) > 1})
            raise ConfigError(f"sweep {override!r} gives {', '.join(twice)} more than once")
        axes.append(Axis(key, raw_key.strip(), values))
    swept = [a.key for a in axes]
    for key in swept:
        given = swept.count(key) + sum(_key_of(o) == key for o in fixed)
        if given > 1:
            raise ConfigError(
                f"{key} is swept and given {given} times; give its values in one override"
            )
    return Grid(tuple(fixed), tuple(axes))


def short_keys(keys: list[str]) -> list[str]:
    """For each dotted key, its shortest tail that no other key of ``keys`` ends with."""
    out = []
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            tail = ".".join(parts[-n:])
            if not any(other != key and (other == tail or other.endswith("." + tail))
                       for other in keys):  # fmt: skip
                break
        out.append(tail)
    return out


def _slug(text: str) -> str:
    plain = _unquote(text) if _is_quoted(text) else text
    return _UNSAFE.sub("_", plain).strip("_") or "_"


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:6]


def value_slugs(values: tuple[str, ...]) -> list[str]:
    """Each value as it appears in a run name: filesystem-safe, distinct within the axis."""
    slugs = [_slug(v) for v in values]
    return [
        s if slugs.count(s) == 1 else f"{s}-{_digest(v)}"
        for s, v in zip(slugs, values, strict=True)
    ]


def _bounded(name: str) -> str:
    if len(name) <= MAX_NAME:
        return name
    return f"{name[: MAX_NAME - 9]}-{_digest(name)}"
