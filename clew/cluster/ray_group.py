"""A worker group of N data-parallel policy workers, each a Ray actor.

Each actor is a thin wrapper around ``DataParallelWorker`` (``clew.cluster.data_parallel``):
it loads the policy itself and joins a ``torch.distributed`` group whose rendezvous the
driver picks on 127.0.0.1, so all workers share this node for now. ``update`` hands each
worker its share of every mini-batch and returns the workers' mean metrics; after it every
worker holds the same weights, those one worker would have reached on the whole batch.

Rollouts across workers are not built yet: ``generate`` raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clew.cluster.data_parallel import DataParallelWorker, free_loopback_address
from clew.data.rows import Row
from clew.errors import ClewError
from clew.rollout.loop import RolloutSettings
from clew.rollout.trajectory import Trajectory
from clew.train.settings import PPOSettings, WorkerSettings
from clew.train.training_batch import TrainingBatch


def _gather(refs: list[Any]) -> list[Any]:
    """``ray.get`` of ``refs``, raising the first failure as soon as it comes (a failed
    worker leaves the others waiting for it at the next collective)."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)  # raises the worker's error, if any
    return ray.get(refs)


class RayWorkerGroup:
    """``num_workers`` policy workers on Ray (already started or joined by the caller)."""

    def __init__(
        self,
        model_path: str | Path,
        settings: WorkerSettings,
        num_workers: int,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        num_cpus_per_worker: float = 1,
        num_gpus_per_worker: float = 0,
        num_threads: int | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        import ray

        if num_workers < 1:
            raise ClewError(f"a worker group needs at least 1 worker, got {num_workers}")
        if not ray.is_initialized():
            raise ClewError("RayWorkerGroup needs Ray: call ray.init() (or join a cluster) first")
        self.world_size = num_workers
        actor = ray.remote(DataParallelWorker).options(
            num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker
        )
        address = free_loopback_address()
        self.workers = [
            actor.remote(
                str(model_path),
                settings,
                rank,
                num_workers,
                address,
                dtype=dtype,
                device=device,
                num_threads=num_threads,
                timeout_s=timeout_s,
            )
            for rank in range(num_workers)
        ]
        try:
            _gather([w.ready.remote() for w in self.workers])
        except Exception:
            self.shutdown()
            raise

    def generate(
        self, rows: Sequence[Row], settings: RolloutSettings, seed: int, progress=None
    ) -> list[Trajectory]:
        raise ClewError(
            "rollouts on a RayWorkerGroup are not supported yet; use LocalWorkerGroup "
            "(one worker) to generate"
        )

    def update(self, batch: TrainingBatch, settings: PPOSettings) -> dict[str, float]:
        """PPO on ``batch``: each worker takes its share of every mini-batch, with
        ``mini_batch_size`` divided by the number of workers. Metrics are worker means."""
        n = self.world_size
        if len(batch) < n:
            raise ClewError(f"a batch of {len(batch)} sequences cannot feed {n} workers")
        shares = batch.split(n, settings.mini_batch_size)
        mini = settings.mini_batch_size
        per_worker = dataclasses.replace(settings, mini_batch_size=mini // n if mini else None)
        metrics = _gather(
            [w.update.remote(s, per_worker) for w, s in zip(self.workers, shares, strict=True)]
        )
        return {k: sum(m[k] for m in metrics) / n for k in metrics[0]}

    def state_dict(self) -> dict[str, Any]:
        """Worker 0's state (every worker holds the same)."""
        return _gather([self.workers[0].state_dict.remote()])[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import ray

        ref = ray.put(state)
        _gather([w.load_state_dict.remote(ref) for w in self.workers])

    def trainable_fingerprints(self) -> list[float]:
        """Each worker's ``trainable_fingerprint``, by rank."""
        return _gather([w.trainable_fingerprint.remote() for w in self.workers])

    def export(self, path: str | Path) -> None:
        """Worker 0 writes the inference-ready policy (a path every worker's node sees)."""
        _gather([self.workers[0].export.remote(str(path))])

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
