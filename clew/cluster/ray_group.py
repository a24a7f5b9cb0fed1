"""A worker group of N data-parallel policy workers, each a Ray actor.

Each actor is a thin wrapper around ``DataParallelWorker`` (``clew.cluster.data_parallel``):
it loads the policy itself and joins a ``torch.distributed`` group. Workers sit in a placement
group (``clew.cluster.placement``), one bundle each, and meet on the node of the first
bundle, or through a store file when all run on this machine (no port opened). The same
workers run SFT (``sft_step``, ``with_policy``, ``write_policy``:
``clew.cluster.group.WorkerGroup``).

``generate`` spreads the rows over the workers in whole GRPO groups (a row is one group of
``n_samples_per_prompt`` episodes), balanced by expected cost (``clew.cluster.balance``),
and returns the trajectories in row order with group ids numbered over the whole batch.
The worker holding row 0 plays with ``seed`` itself, so one worker reproduces
``LocalWorkerGroup``; another plays with a seed derived from ``seed`` and its first row
(``chunk_seed``). The samples therefore depend on the number of workers: making them
independent of it would take one random stream per row inside the batched sampler.

``update`` hands each worker its share of every mini-batch and returns the workers' mean
metrics; after it every worker holds the same weights, those one worker would have reached
on the whole batch. It then compares the workers' fingerprints of their trainable weights
and stops the run on any difference: silent weight desync would otherwise train diverged
copies and sample from them unnoticed.

A worker whose actor dies raises ``WorkerLost``; one that cannot start raises
``WorkerStartFailed`` (``clew.cluster.ray_calls``), except where rank 0 could not listen on
the rendezvous port (a ``tcp://`` port is chosen free, and another process may take it
before rank 0 listens): the group then starts its workers again on another port, up to
``START_ATTEMPTS`` times.

Given a ``name`` (a run's is ``clew-<run name>``), the actors are named ``<name>-worker-<rank>``
in the driver's Ray namespace, so ``ray list actors`` and the dashboard tell the ranks and
runs apart; a name another live actor of the namespace holds fails naming it.
``shutdown`` waits until the names are free, so a new group of the same run (a restart)
can take them at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clew.cluster.balance import assign_rows, count_split, expected_cost
from clew.cluster.data_parallel import DataParallelWorker
from clew.cluster.placement import rendezvous_in
from clew.cluster.ray_calls import (
    SHUTDOWN_WAIT_S,
    START_ATTEMPTS,
    WorkerLost,
    WorkerStartFailed,
    gather,
    lost_worker,
    port_taken,
    start_cause,
    wait_until_free,
    worker_name,
)
from clew.data.rows import Row
from clew.envs.plugins import REGISTER_HINT, unresolved_env_ids
from clew.errors import ClewError, EnvError
from clew.rollout.loop import RolloutSettings
from clew.rollout.trajectory import Trajectory
from clew.train.grad_sync import local_rendezvous, remove_rendezvous
from clew.train.settings import PPOSettings, WorkerSettings
from clew.train.training_batch import TrainingBatch, share_sizes


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
        placement_group: Any = None,
        on_this_machine: bool = False,
        env_vars: dict[str, str] | None = None,
        name: str | None = None,
        **worker_options: Any,
    ) -> None:
        """``placement_group``: one bundle per worker (``clew.cluster.placement``), a GPU
        each when the bundles hold GPUs; without it, workers take
        ``num_cpus/gpus_per_worker`` anywhere. ``on_this_machine``: every worker runs here
        (an embedded Ray), so they meet through a store file. ``env_vars`` are set in the workers'
        processes. ``name``: the actors are ``<name>-worker-<rank>`` (None: unnamed).
        ``worker_options`` go to ``DataParallelWorker`` (seed, engine options, ...).
        """
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if num_workers < 1:
            raise ClewError(f"a worker group needs at least 1 worker, got {num_workers}")
        if not ray.is_initialized():
            raise ClewError(
                "RayWorkerGroup needs Ray: start one (clew.ray_connect.start_local_ray) "
                "or join a cluster (connect_ray) first"
            )
        self.world_size = num_workers
        self.placement_group = placement_group
        self.device = device
        self.owns_ray = False  # set by whoever started Ray for this group alone
        self.model_path = Path(model_path)
        self._chat: Any = None
        actor = ray.remote(DataParallelWorker)
        runtime_env = {"env_vars": dict(env_vars)} if env_vars else {}
        if placement_group is None:
            options = [
                {"num_cpus": num_cpus_per_worker, "num_gpus": num_gpus_per_worker}
                for _ in range(num_workers)
            ]
        else:
            gpus = int(placement_group.bundle_specs[0].get("GPU", 0))
            options = [
                {
                    "num_cpus": 1,
                    "num_gpus": gpus,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group, placement_group_bundle_index=rank
                    ),
                }
                for rank in range(num_workers)
            ]
        self.workers = []
        self.names = [] if name is None else [worker_name(name, r) for r in range(num_workers)]
        for attempt in range(1, START_ATTEMPTS + 1):
            self.rendezvous = (
                local_rendezvous()  # opens no port
                if placement_group is None or on_this_machine
                else rendezvous_in(placement_group)
            )
            try:
                for rank in range(num_workers):
                    named = {"name": self.names[rank]} if self.names else {}
                    self.workers.append(
                        actor.options(**options[rank], **named, runtime_env=runtime_env).remote(
                            str(model_path),
                            settings,
                            rank,
                            num_workers,
                            self.rendezvous,
                            dtype=dtype,
                            device=device,
                            num_threads=num_threads,
                            timeout_s=timeout_s,
                            **worker_options,
                        )
                    )
            except ValueError as exc:  # Ray's answer to a name already taken
                taken = self.names[len(self.workers)]
                self.names = self.names[: len(self.workers)]  # the names this group holds
                self.shutdown()
                raise ClewError(
                    f"Ray refused the worker actor name {taken!r} ({exc}): another live run "
                    "of that name holds it in this Ray namespace; give this run another "
                    "trainer.run_name (or sft.run_name), or stop the other run"
                ) from None
            try:
                self._await_start()
                self.sharded = bool(
                    gather([self.workers[0].__ray_call__.remote(_is_sharded)], self.workers)[0]
                )
                return
            except WorkerStartFailed as exc:
                # A tcp:// rendezvous names a port that was free when chosen; another
                # process may take it before rank 0 listens. Another port, other workers.
                if not port_taken(exc) or attempt == START_ATTEMPTS:
                    self.shutdown()
                    raise
                self._kill_workers()
                print(f"{exc}; starting the workers again on another port", flush=True)
            except BaseException:
                self.shutdown()
                raise

    def _await_start(self) -> None:
        """Wait until every worker has loaded the policy and joined the group; a worker
        that could not start fails naming its rank, node and cause."""
        import ray

        refs = [w.ready.remote() for w in self.workers]
        rank_of = {r: i for i, r in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as exc:
                if not exc.actor_init_failed:
                    raise WorkerLost(
                        f"worker {rank_of[done[0]]} died while starting: {exc}"
                    ) from exc
                rank = rank_of[done[0]]
                raise WorkerStartFailed(
                    f"worker {rank} of {self.world_size} could not start: {start_cause(exc)}"
                ) from None

    def generate(
        self, rows: Sequence[Row], settings: RolloutSettings, seed: int, progress=None
    ) -> list[Trajectory]:
        """Every row played ``n_samples_per_prompt`` times, spread over the workers by
        expected cost; the trajectories in (row, sample) order, ``group_id`` the row's
        index in ``rows``."""
        import ray

        parts = assign_rows([expected_cost(r) for r in rows], self.world_size)
        if self.sharded:  # gathering sharded weights takes every worker, one with no rows too
            parts += [[] for _ in range(self.world_size - len(parts))]
        refs = [
            self.workers[w].generate.remote(
                [rows[i] for i in part], settings, chunk_seed(seed, part[0] if part else 0)
            )
            for w, part in enumerate(parts)
        ]
        pending, order = list(refs), {r: i for i, r in enumerate(refs)}
        by_row: dict[int, list[Trajectory]] = {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            w = order[done[0]]
            try:
                played = ray.get(done[0])
            except ray.exceptions.RayError as exc:
                lost = lost_worker(exc, self.workers)
                if lost is None:
                    raise
                raise lost from exc
            for t in played:  # the worker numbered its rows' groups 0, 1, ...
                t.group_id = parts[w][t.group_id]
                by_row.setdefault(t.group_id, []).append(t)
            if progress:
                progress(len(played))
        return [t for i in sorted(by_row) for t in by_row[i]]

    def update(self, batch: TrainingBatch, settings: PPOSettings) -> dict[str, float]:
        """PPO on ``batch``: each worker takes its share of every mini-batch (shares differ
        by at most one sequence; a batch smaller than the group leaves some empty). Metrics
        are worker means, ``*_max`` ones the largest of the workers'."""
        n = self.world_size
        shares = batch.split(n, settings.mini_batch_size)
        sizes = share_sizes(len(batch), settings.mini_batch_size, n)
        metrics = gather(
            [
                w.update.remote(s, dataclasses.replace(settings, mini_batch_sizes=tuple(k)))
                for w, s, k in zip(self.workers, shares, sizes, strict=True)
            ],
            self.workers,
        )
        self.check_in_step()
        return {
            k: max(m[k] for m in metrics) if k.endswith("_max") else sum(m[k] for m in metrics) / n
            for k in metrics[0]
        }

    def check_in_step(self) -> None:
        """Raise ``ClewError`` unless every worker's trainable weights match worker 0's.
        Exact equality: the workers apply the same all-reduced gradients to the same
        weights, so any difference at all is a desync."""
        prints = self.trainable_fingerprints()
        off = [r for r, f in enumerate(prints) if f != prints[0]]
        if off:
            listed = ", ".join(f"worker {r}: {f!r}" for r, f in enumerate(prints))
            raise ClewError(
                f"weight desync: the trainable weights of worker(s) {off} differ from worker "
                f"0's after the update (fingerprints {listed}); stopping rather than train "
                "and sample from diverged copies. The checkpoints already written are kept."
            )

    def state_dict(self) -> dict[str, Any]:
        """Worker 0's state, with whole tensors. Sharded workers (``trainer.strategy=fsdp``)
        all take part, gathering their shards for it; else worker 0 alone answers, so the
        checkpoint of a step whose other worker died is still written."""
        return gather([w.state_dict.remote() for w in self._holders()], self.workers)[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import ray

        ref = ray.put(state)
        gather([w.load_state_dict.remote(ref) for w in self.workers], self.workers)

    def trainable_fingerprints(self) -> list[float]:
        """Each worker's ``trainable_fingerprint``, by rank."""
        return gather([w.trainable_fingerprint.remote() for w in self.workers], self.workers)

    def export(self, path: str | Path) -> None:
        """Worker 0 writes the inference-ready policy (a path every worker's node sees),
        with every worker's help when they are sharded, as for ``state_dict``."""
        gather([w.export.remote(str(path)) for w in self._holders()], self.workers)

    def _holders(self) -> list[Any]:
        """The workers that hold the whole policy between them: all when sharded, else
        worker 0."""
        return self.workers if self.sharded else self.workers[:1]

    # -- SFT (``clew.cluster.group.WorkerGroup``) ------------------------------------
    @property
    def chat(self) -> Any:
        """The policy's chat format, loaded here from the model's processor: SFT encodes
        its demonstrations in the driver."""
        if self._chat is None:
            from clew.models.chat import ChatFormat
            from clew.models.loading import load_processor

            self._chat = ChatFormat(load_processor(self.model_path))
        return self._chat

    def sft_step(self, demos: Sequence[Any], micro_batch_size: int) -> dict[str, float]:
        """One SFT optimizer step on ``demos``, spread over the workers by count (a worker
        may get none); the step one worker takes on the whole batch. Metrics: worker 0's
        (the loss and gradient norm are the whole batch's on every worker)."""
        shares = [demos[lo:hi] for lo, hi in count_split(len(demos), self.world_size)]
        metrics = gather(
            [
                w.sft_step.remote(s, micro_batch_size)
                for w, s in zip(self.workers, shares, strict=True)
            ],
            self.workers,
        )
        self.check_in_step()
        return metrics[0]

    def with_policy(self, fn: Any, *args: Any) -> Any:
        """``fn(model, chat, *args)`` on worker 0's weights (on every worker when they are
        sharded, as gathering them takes all), worker 0's result."""
        targets = self._holders()
        return gather([w.with_policy.remote(fn, *args) for w in targets], self.workers)[0]

    def write_policy(self, directory: str | Path) -> None:
        """Worker 0 writes the policy with LoRA merged in, and its processor."""
        gather([w.write_policy.remote(str(directory)) for w in self._holders()], self.workers)

    def peak_memory_gb(self) -> float | None:
        """The largest of the workers' peak device memory since the previous call, in GB
        (``clew.cluster.group.peak_memory_gb``); None for CPU workers."""
        if self.device != "cuda":
            return None
        peaks = gather([w.__ray_call__.remote(_worker_peak) for w in self.workers], self.workers)
        measured = [p for p in peaks if p is not None]
        return max(measured) if measured else None

    def check_envs(self, env_ids: Sequence[str]) -> None:
        """Raise an ``EnvError`` unless every worker can build the envs of ``env_ids``,
        naming the first id a worker does not know, the worker and how to register it."""
        ids = sorted(set(env_ids))
        found = gather(
            [w.__ray_call__.remote(_unresolved_envs, ids) for w in self.workers], self.workers
        )
        for rank, missing in enumerate(found):
            if missing:
                env_id, why = next(iter(missing.items()))
                raise EnvError(
                    f"environment id {env_id!r} of the run's data is unknown to Ray worker "
                    f"{rank} of {self.world_size} ({why}), so every episode of it would fail "
                    f"there; the driver's own registrations do not reach the workers: "
                    f"{REGISTER_HINT}"
                )

    def shutdown(self) -> None:
        """Kill the workers and wait (up to ``SHUTDOWN_WAIT_S``) until their names are free;
        remove the placement group; stop Ray if the group owns it."""
        import ray

        self._kill_workers()
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(ray.exceptions.RayError):
                remove_placement_group(self.placement_group)
            self.placement_group = None
        remove_rendezvous(getattr(self, "rendezvous", ""))
        if self.owns_ray:
            ray.shutdown()

    def _kill_workers(self) -> None:
        """Kill the workers and wait (up to ``SHUTDOWN_WAIT_S``) until their names are free."""
        import ray

        for w in self.workers:
            with contextlib.suppress(ray.exceptions.RayError):  # already gone is fine
                ray.kill(w)
        if self.names and not self.owns_ray and ray.is_initialized():
            wait_until_free(self.names, SHUTDOWN_WAIT_S)
        self.workers = []


def _unresolved_envs(actor: Any, env_ids: list[str]) -> dict[str, str]:
    """Run in a worker's process (Ray's ``__ray_call__``): the ids it cannot build."""
    return unresolved_env_ids(env_ids)


def _worker_peak(actor: Any) -> float | None:
    """Run in a worker's process (Ray's ``__ray_call__``): its GPU's peak memory, None
    where the process has no GPU."""
    import torch

    from clew.cluster.group import peak_memory_gb

    if not torch.cuda.is_available():
        return None
    return peak_memory_gb(torch.device("cuda", torch.cuda.current_device()))


def chunk_seed(seed: int, first_row: int) -> int:
    """The rollout seed of a worker's rows, the first of them ``first_row``: ``seed`` itself
    for the worker with row 0, else a value mixed from both (kept below 2**31 so ``play``'s own arithmetic on it
    stays in a generator's range)."""
    return seed if first_row == 0 else (seed * 1_000_003 + first_row * 7_919) % 2**31


def _is_sharded(worker: DataParallelWorker) -> bool:
    return worker.sharded
