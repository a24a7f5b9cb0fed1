"""Calls to a group's Ray actors, and how they fail.

A worker whose actor dies (killed, its process crashed, its node gone) is ``WorkerLost``,
whichever call noticed it: the group is then unusable, but a run can go on from its latest
checkpoint on a new one. A worker that raised while starting is ``WorkerStartFailed``,
naming its cause as the worker's own code raised it (not Ray's wrapping): it would only
fail again. An exception raised by a worker's own code later is not a death and
propagates as it is.

Named actors (``worker_name``) free their names when killed; ``wait_until_free`` waits
for that before a group of the same names is started again.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

from clew.errors import ClewError


class WorkerLost(ClewError):
    """A policy worker's actor died: its process or node is gone, not an error in its code."""


class WorkerStartFailed(ClewError):
    """A policy worker raised while starting (loading the policy, joining the group): the
    same error would come again, so the run fails rather than restart (except where the
    rendezvous port was taken meanwhile: ``port_taken``)."""


# Starts of a worker group, each on a newly chosen rendezvous port, before the group fails.
START_ATTEMPTS = 3


def port_taken(exc: WorkerStartFailed) -> bool:
    """Whether rank 0 could not listen on the rendezvous port: another process took it
    between its choice and the group's start, and another port may do."""
    return "EADDRINUSE" in str(exc)


def start_cause(exc: Exception) -> str:
    """The original error of a Ray actor that failed in its constructor, from the last line
    of the traceback Ray wraps it in, with the node's address where Ray gives it."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines else type(exc).__name__
    kind, sep, message = last.partition(": ")
    if sep and kind.startswith("clew.errors."):  # clew's errors say what and where already
        last = message
    elif sep:
        last = f"{kind.rsplit('.', 1)[-1]}: {message}"
    node = re.search(r"\bip=([^,)\s]+)", text)
    return f"{last} (on node {node.group(1)})" if node else last


def dead_ranks(workers: Sequence[Any], wait_s: float = 5.0) -> list[int]:
    """The ranks whose actors are dead. A live worker blocked in a collective with a dead
    peer does not answer the ping in time and counts as alive."""
    import ray

    pings = [w.__ray_ready__.remote() for w in workers]
    ray.wait(pings, num_returns=len(pings), timeout=wait_s)
    dead = []
    for rank, ping in enumerate(pings):
        ready, _ = ray.wait([ping], timeout=0)
        if ready:
            try:
                ray.get(ping)
            except ray.exceptions.RayActorError:
                dead.append(rank)
    return dead


def lost_worker(exc: Exception, workers: Sequence[Any]) -> WorkerLost | None:
    """``exc`` as a ``WorkerLost`` when a worker died, else None. A worker's own exception
    counts only when a peer is dead too: the survivor of a collective fails with a
    connection error, sometimes before Ray reports the death."""
    import ray

    if not isinstance(exc, ray.exceptions.RayError):
        return None
    died = isinstance(exc, ray.exceptions.RayActorError)
    dead = dead_ranks(workers) if workers else []
    if not (died or dead):
        return None
    cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    who = f"worker(s) {dead}" if dead else "a worker"
    return WorkerLost(f"{who} of the policy group died ({type(exc).__name__}: {cause})")


def gather(refs: list[Any], workers: Sequence[Any] = ()) -> list[Any]:
    """``ray.get`` of ``refs``, raising the first failure as soon as it comes (a failed
    worker leaves the others waiting for it at the next collective); ``WorkerLost`` when
    one of ``workers`` died."""
    import ray

    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)  # raises the worker's error, if any
        return ray.get(refs)
    except ray.exceptions.RayError as exc:
        lost = lost_worker(exc, workers)
        if lost is None:
            raise
        raise lost from exc


SHUTDOWN_WAIT_S = 30.0


def worker_name(name: str, rank: int) -> str:
    """The Ray actor name of worker ``rank`` of a group named ``name``."""
    return f"{name}-worker-{rank}"


def wait_until_free(names: Sequence[str], timeout_s: float) -> None:
    """Return once no live actor holds any of ``names``, or after ``timeout_s``."""
    import ray

    deadline = time.monotonic() + timeout_s
    for n in names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(n)
            except ValueError:  # no live actor of that name
                break
            time.sleep(0.05)
