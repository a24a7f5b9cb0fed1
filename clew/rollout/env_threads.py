"""The threads that step a rollout's envs and encode their observations.

Between two turns the engine waits for every episode's env step and the encoding of its
next observation. ``generator.env_workers`` threads do this per episode at once (Pillow
and numpy release the GIL for their work); ``clew.rollout.loop`` says what runs on them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

# Episodes started together ahead of the wave that admits them (their envs reset and first
# observations encoded on the env threads).
START_AHEAD = 64
# The default's cap: 8 threads already spread a 192-episode turn's host work thin, and a
# many-core host keeps its other cores for the processes beside the trainer (Ray's, data
# loading).
ENV_WORKERS_MAX = 8


def env_threads(requested: int) -> int:
    """The threads ``env_workers=requested`` runs (0: one per CPU core, at most 8)."""
    if requested > 0:
        return requested
    affinity = getattr(os, "sched_getaffinity", None)  # not on macOS
    cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    return max(1, min(ENV_WORKERS_MAX, cores))


@contextlib.contextmanager
def env_pool(threads: int) -> Iterator[Any]:
    """Something with ``map`` running on ``threads`` threads (the caller's own if one).

    Its ``map`` hands each thread one contiguous slice of the items rather than one task
    per item: a task costs a future, a lock and a wake-up, which for a maze turn (tens of
    microseconds of work an episode) cost more than the work itself. Results come back in
    the items' order."""
    if threads <= 1:
        yield SimpleNamespace(map=map)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="clew-env") as pool:

        def sliced_map(fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
            items = list(items)
            size = max(1, -(-len(items) // threads))
            slices = [items[i : i + size] for i in range(0, len(items), size)]
            done = pool.map(lambda part: [fn(item) for item in part], slices)
            return itertools.chain.from_iterable(done)

        yield SimpleNamespace(map=sliced_map)
