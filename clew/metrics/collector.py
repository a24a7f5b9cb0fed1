"""One step's metrics, gathered in one place and reduced once.

The training loop produces numbers in many places (rollout, advantage computation, each
optimizer mini-batch, timers around every phase). Instead of each place doing its own
bookkeeping (running sums, ``.item()`` calls, "is this a tensor?" checks), they hand values to a
:class:`MetricsCollector`; at the end of the step ``flush(step)`` reduces everything to one
flat ``dict[str, float]`` that the loggers write, and starts the next step empty.

Reductions, chosen so the common call sites need no arguments:

* ``add`` of the same name several times in a step averages them (a loss added once per
  mini-batch reports the step's mean loss); pass ``reduce="sum"`` for counters, ``"max"`` /
  ``"min"`` for extremes, ``"last"`` for values like the learning rate.
* ``extend`` collects per-episode values; the name you pass gets their mean, and with
  ``extremes=True`` also ``<base>_min`` / ``<base>_max`` (``train/reward_mean`` gives
  ``train/reward_min`` / ``train/reward_max``).
* ``timer(phase)`` sums wall seconds into ``timing/<phase>`` (a phase entered twice in a step,
  e.g. generation in two chunks, reports its total).

A NaN loss or an infinite grad norm is exactly the signal that a run has gone wrong, so
non-finite values are never dropped or replaced: they are kept as they are, counted in
``metrics/non_finite``, and named in a warning, so a silent NaN cannot hide in a plot.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

Reduce = Literal["mean", "sum", "min", "max", "last"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "min", "max", "last")

NON_FINITE_KEY = "metrics/non_finite"
TIMING_PREFIX = "timing/"

log = logging.getLogger(__name__)


def to_float(value: Any, name: str = "value") -> float:
    """Convert a Python/numpy/torch scalar to ``float``.

    Duck-typed on ``.item()`` so neither numpy nor torch has to be imported here; a tensor or
    array with more than one element is a caller bug (use ``extend``), hence ``TypeError``.
    """
    if isinstance(value, bool | int | float):
        return float(value)
    item = getattr(value, "item", None)
    if item is not None:
        # torch's .size is a method and numpy's an int, so ask torch for numel() instead.
        numel = value.numel() if hasattr(value, "numel") else getattr(value, "size", 1)
        if numel != 1:
            raise TypeError(
                f"metric {name!r}: expected a scalar, got an array of {numel} elements "
                "(use MetricsCollector.extend for per-episode values)"
            )
        return float(item())
    # Strings are refused even when numeric: a "0.5" here means a formatting bug upstream.
    if not isinstance(value, str | bytes):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"metric {name!r}: expected a number, got {type(value).__name__}")


def _to_floats(values: Any, name: str) -> list[float]:
    """Flatten a list, tuple, 1-d tensor or array of scalars into floats."""
    tolist = getattr(values, "tolist", None)
    if tolist is not None:
        # .tolist() moves a (CUDA) tensor to host once instead of one sync per element.
        values = tolist()
        if not isinstance(values, list):
            values = [values]
    return [to_float(v, name) for v in values]


def spread_names(name: str) -> tuple[str, str]:
    """Names of the min/max companions of a mean metric ``name``.

    ``train/reward_mean`` -> ``train/reward_min``, ``train/reward_max``; a name without the
    ``_mean`` suffix gets ``_min`` / ``_max`` appended.
    """
    base = name.removesuffix("_mean")
    return f"{base}_min", f"{base}_max"


def _extreme(which: str, xs: Iterable[float]) -> float:
    """``min``/``max`` that propagates NaN (builtin min/max drop it depending on order)."""
    xs = list(xs)
    if any(math.isnan(x) for x in xs):
        return math.nan
    return min(xs) if which == "min" else max(xs)


@dataclass
class _Scalar:
    reduce: str
    total: float = 0.0
    count: int = 0

    def update(self, value: float) -> None:
        if self.reduce in ("mean", "sum"):
            self.total += value
        elif self.count == 0 or self.reduce == "last":
            self.total = value
        else:
            self.total = _extreme(self.reduce, (self.total, value))
        self.count += 1

    def result(self) -> float:
        return self.total / self.count if self.reduce == "mean" else self.total


class MetricsCollector:
    """Accumulates one training step's metrics; ``flush(step)`` reduces and resets.

    Thread-safe: rollout workers may ``extend`` while the main loop times a phase.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scalars: dict[str, _Scalar] = {}
        self._lists: dict[str, list[float]] = {}
        self._extremes: set[str] = set()
        self._non_finite: dict[str, int] = {}

    def _count_non_finite(self, name: str, values: Iterable[float]) -> None:
        bad = sum(1 for v in values if not math.isfinite(v))
        if bad:
            self._non_finite[name] = self._non_finite.get(name, 0) + bad

    def add(self, name: str, value: Any, *, reduce: Reduce = "mean") -> None:
        """Record a scalar (float, int, bool, 0-d tensor, numpy scalar) for this step.

        Repeated adds of ``name`` within a step are combined by ``reduce``; one name must keep
        one reduction for the whole step, since mixing them has no meaning.
        """
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
        x = to_float(value, name)
        with self._lock:
            if name in self._lists:
                raise ValueError(f"metric {name!r} is already a per-episode list this step")
            slot = self._scalars.setdefault(name, _Scalar(reduce))
            if slot.reduce != reduce:
                raise ValueError(
                    f"metric {name!r} was added with reduce={slot.reduce!r}, now {reduce!r}"
                )
            slot.update(x)
            self._count_non_finite(name, (x,))

    def add_many(self, metrics: Mapping[str, Any], *, reduce: Reduce = "mean") -> None:
        """``add`` every item of ``metrics`` (e.g. the stats dict a loss function returns)."""
        for name, value in metrics.items():
            self.add(name, value, reduce=reduce)

    def extend(self, name: str, values: Any, *, extremes: bool = False) -> None:
        """Record per-episode values; flushed as their mean under ``name``.

        With ``extremes=True`` the flush also reports min and max (see :func:`spread_names`).
        An empty ``values`` is allowed (a step where every episode failed still calls this) and
        reports nothing unless other calls added values.
        """
        xs = _to_floats(values, name)
        with self._lock:
            if name in self._scalars:
                raise ValueError(f"metric {name!r} is already a scalar this step")
            self._lists.setdefault(name, []).extend(xs)
            if extremes:
                self._extremes.add(name)
            self._count_non_finite(name, xs)

    @contextmanager
    def timer(self, phase: str) -> Iterator[None]:
        """Add the wall seconds spent in the ``with`` block to ``timing/<phase>``.

        Recorded even if the block raises, so a step that fails half-way still shows where its
        time went.
        """
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(TIMING_PREFIX + phase, time.perf_counter() - start, reduce="sum")

    def peek(self, name: str) -> float | None:
        """The value ``name`` would flush as now, or ``None`` if nothing was recorded.

        Lets the loop derive metrics (e.g. throughput from a timing) before flushing.
        """
        with self._lock:
            if name in self._scalars:
                return self._scalars[name].result()
            xs = self._lists.get(name)
            return sum(xs) / len(xs) if xs else None

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._scalars or bool(self._lists.get(name))

    def flush(self, step: int) -> dict[str, float]:
        """Return this step's reduced metrics (sorted by name) and start an empty step.

        ``metrics/non_finite`` is always present when anything was recorded, so its history
        shows 0 for healthy steps rather than a gap.
        """
        with self._lock:
            scalars, lists, extremes, non_finite = (
                self._scalars,
                self._lists,
                self._extremes,
                self._non_finite,
            )
            self._scalars, self._lists, self._extremes, self._non_finite = {}, {}, set(), {}

        out: dict[str, float] = {name: slot.result() for name, slot in scalars.items()}
        for name, xs in lists.items():
            if not xs:
                continue
            out[name] = math.fsum(xs) / len(xs)
            if name in extremes:
                lo, hi = spread_names(name)
                out[lo], out[hi] = _extreme("min", xs), _extreme("max", xs)
        if not out:
            return {}
        out[NON_FINITE_KEY] = float(sum(non_finite.values()))
        if non_finite:
            detail = ", ".join(f"{k} ({n})" for k, n in sorted(non_finite.items()))
            log.warning("step %d: non-finite metric values: %s", step, detail)
        return dict(sorted(out.items()))
