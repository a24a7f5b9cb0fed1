"""Data-parallel ranks in spawned processes, for the tests of sharded (FSDP) training.

``Ranks(n, model_dir, settings, ...)`` starts ``n`` ``DataParallelWorker`` ranks of one
group, each in its own process (a process group needs one process per rank), and drives
them over pipes; ``FULL``, ``ATOL`` and ``assert_same_weights`` compare their state with one
worker's.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import traceback
from operator import attrgetter
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from clew.cluster.data_parallel import DataParallelWorker
from clew.train import WorkerSettings
from clew.train.fsdp import gathered
from clew.train.grad_sync import free_loopback_address

# Full fine-tuning; the KL reference is kept so that reference scoring runs sharded too.
FULL = WorkerSettings(lr=1e-3, max_grad_norm=0.5, kl_reference=True)

# AdamW's first steps move every weight by about lr whatever its gradient's size, so a weight
# whose gradient is near 0 turns the float rounding of a different summation order into
# steps of up to a few percent of lr (5.5% seen with transformers 5.25); everything else
# agrees to about 1e-6, and a wrong step moves weights by about lr.
ATOL = 0.1 * FULL.lr


def assert_same_weights(a: dict, b: dict, atol: float = ATOL) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def gathered_inside_gathered(worker: DataParallelWorker) -> list[bool]:
    """On a rank (``Ranks.call("module:gathered_inside_gathered")``): whether the weights
    are whole in an outer ``gathered`` block after an inner one, and after both."""
    model = worker.worker.model
    whole = []
    with gathered(model):
        with gathered(model):
            pass
        whole.append(not any(isinstance(p, DTensor) for p in model.parameters()))
    whole.append(not any(isinstance(p, DTensor) for p in model.parameters()))
    return whole


def _serve(conn: Any, args: tuple, kwargs: dict) -> None:
    """One rank: build the worker, then run ``(method path, args, kwargs)`` calls on it."""
    try:
        worker = DataParallelWorker(*args, **kwargs)
        conn.send(("ok", worker.rank))
        while (msg := conn.recv()) is not None:
            name, a, kw = msg
            try:
                if name.startswith("module:"):  # a function of this module, on the worker
                    value = functools.partial(globals()[name.removeprefix("module:")], worker)
                else:
                    value = attrgetter(name)(worker)
                conn.send(("ok", value(*a, **kw) if callable(value) else value))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
        worker.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class Ranks:
    """``DataParallelWorker`` ranks of one group, each in its own process."""

    def __init__(self, n: int, *args: Any, **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        address = free_loopback_address()
        self.conns, self.procs = [], []
        for rank in range(n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_serve,
                args=(theirs, (args[0], args[1], rank, n, address, *args[2:]), kwargs),
                daemon=True,
            )
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)
        self._replies()

    def _replies(self, timeout_s: float = 180.0) -> list[Any]:
        out = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(timeout_s):
                raise TimeoutError(f"rank {rank} did not answer in {timeout_s} s")
            status, value = conn.recv()
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out.append(value)
        return out

    def call(self, name: str, *args: Any, per_rank: list[tuple] | None = None) -> list[Any]:
        """``name`` on every rank, with ``args`` or each rank's own ``per_rank`` arguments:
        a worker attribute (a method path such as ``"update"``), or ``"module:<function>"``
        for a function of this module called with the rank's worker first."""
        for rank, conn in enumerate(self.conns):
            conn.send((name, per_rank[rank] if per_rank else args, {}))
        return self._replies()

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # that rank is gone already
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
