"""Data-parallel policy workers: the gradient sync between workers and one worker's rank.

Each of N workers holds the same weights and its share of every mini-batch
(``TrainingBatch.split``). ``PolicyWorker`` asks its ``sync`` for the mini-batch's global
token and sequence counts (so each worker's losses are scaled as one worker's would be) and,
before clipping, for the sum of the gradients over workers; every worker then takes the
same optimizer step. ``TorchDistributedSync`` does this with ``torch.distributed`` (gloo on
CPU, NCCL on CUDA) over the trainable parameters only: with LoRA only the adapter's
gradients travel.

``DataParallelWorker`` is one rank as a plain class (the Ray actor of
``clew.cluster.ray_group`` wraps it): it loads the policy, joins the process group and
starts from rank 0's trainable weights (LoRA adapters are initialised at random). It also
plays rollouts, colocated: an ``InferenceEngine`` samples from the very modules the rank
trains (a LoRA adapter merged while it samples), so every rank samples from the trained
weights after each step with nothing to copy.

With ``strategy`` ``fsdp`` (``fsdp2``), several ranks and full fine-tuning, each rank holds
a shard of the policy (``clew.cluster.fsdp``): it samples from the gathered weights, freed
again before the update, and the state and export methods are collectives that every rank
must join (rank 0 returns the state and writes the export; so it does without sharding).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Sequence
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from clew.cluster import fsdp
from clew.data.rows import Row
from clew.errors import ModelError
from clew.inference.engine import EngineOptions
from clew.inference.runtime import limit_host_threads
from clew.metrics.progress import library_bars_off
from clew.models.hf_export import write_companion_files
from clew.rollout.loop import RolloutSettings, play
from clew.rollout.trajectory import Trajectory
from clew.train.lora import merged_for_rollouts
from clew.train.settings import PPOSettings, WorkerSettings
from clew.train.training_batch import TrainingBatch
from clew.train.worker import PolicyWorker

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class GradSync(Protocol):
    """How data-parallel workers agree. Every worker makes the same calls in the same order
    (one with nothing to learn from included), or they wait for each other forever."""

    def total(self, x: float) -> float:
        """The sum of ``x`` over all workers."""
        ...

    def reduce_(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace each parameter's ``.grad`` (None counts as zeros) by its sum over workers."""
        ...


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), "lo")


class TorchDistributedSync:
    """``GradSync`` over the default ``torch.distributed`` process group."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @classmethod
    def join(
        cls,
        init_method: str,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float = 300.0,
    ) -> TorchDistributedSync:
        """Join the group at ``init_method``: ``tcp://host:port`` (rank 0 listens there) or
        ``file://path`` (workers of one machine: ``local_rendezvous``)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        parsed = urlparse(init_method)
        if backend == "gloo" and (parsed.scheme == "file" or parsed.hostname in LOOPBACK):
            # Gloo otherwise listens on the address the host name resolves to.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        return cls(device)

    def total(self, x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item())

    def reduce_(self, params: Sequence[torch.nn.Parameter]) -> None:
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            if p.grad is None:  # unused here but maybe not elsewhere: all must step alike
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            # One all-reduce per dtype rather than one per tensor (many small LoRA matrices).
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(summed)

    def broadcast_(self, params: Sequence[Tensor], src: int = 0) -> None:
        """Overwrite ``params`` with rank ``src``'s."""
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_loopback_address() -> str:
    """A ``tcp://127.0.0.1:port`` with a port free now, for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def local_rendezvous() -> str:
    """A ``file://`` rendezvous for workers that all run on this machine: a store file in a
    new temporary folder (``remove_rendezvous`` deletes it). Unlike a ``tcp://`` one it
    opens no port: rank 0's TCP store listens on every interface, whatever host the address
    names, while gloo's own connections stay on loopback (``GLOO_SOCKET_IFNAME``)."""
    return (Path(tempfile.mkdtemp(prefix="clew-rendezvous-")) / "store").as_uri()


def remove_rendezvous(init_method: str) -> None:
    """Delete the folder of a ``local_rendezvous`` store; other addresses are left alone."""
    parsed = urlparse(init_method)
    if parsed.scheme == "file":
        shutil.rmtree(Path(parsed.path).parent, ignore_errors=True)


class DataParallelWorker:
    """Rank ``rank`` of ``world_size`` data-parallel policy workers."""

    def __init__(
        self,
        model_path: str | Path,
        settings: WorkerSettings,
        rank: int,
        world_size: int,
        init_method: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        num_threads: int | None = None,
        timeout_s: float = 300.0,
        seed: int = 0,
        engine: EngineOptions | None = None,
        allowed_tokens: Sequence[Sequence[str]] = (),
        strategy: str = "fsdp",
    ) -> None:
        library_bars_off()  # a worker's stderr is a log file (and `ray job logs`)
        if num_threads:
            torch.set_num_threads(num_threads)
        engine = engine or EngineOptions()
        # Dropout and any other draw from torch's global generator differ by rank but not by run.
        torch.manual_seed(seed + rank)
        self.rank, self.world_size = rank, world_size
        try:
            self.worker = PolicyWorker.from_pretrained(
                model_path, settings, dtype=dtype, device=device
            )
        except Exception as e:
            raise ModelError(
                f"worker {rank} of {world_size} could not load the policy from {model_path}: "
                f"{type(e).__name__}: {e}"
            ) from e
        self.sync = TorchDistributedSync.join(
            init_method, rank, world_size, self.worker.device, timeout_s
        )
        self.sync.broadcast_(self._trainable())
        self.worker.sync = self.sync
        if fsdp.shards_policy(strategy, world_size, settings.lora_rank):
            fsdp.shard_worker(self.worker)
        device = self.worker.device
        limit_host_threads(device)
        # The cache budget takes the device's free memory: measure it with the weights
        # whole, as they are while sampling.
        with fsdp.gathered(self.worker.model) if device.type == "cuda" else nullcontext():
            budget = engine.budget(device)
        self.engine = engine.build(
            self.worker.model,
            self.worker.chat,
            autocast=settings.autocast_bf16,
            max_cache_bytes=budget,
        )
        for tokens in allowed_tokens:  # a token text that is not one token fails here
            self.engine.allowed_ids(tuple(tokens))

    def __repr__(self) -> str:
        # Ray prefixes the actor's log lines with this (`ray job logs`, the driver's console).
        rank, size = getattr(self, "rank", "?"), getattr(self, "world_size", "?")
        return f"DataParallelWorker(rank {rank} of {size})"

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.worker.model.parameters() if p.requires_grad]

    def ready(self) -> int:
        return self.rank

    def generate(
        self, rows: Sequence[Row], settings: RolloutSettings, seed: int, first_group: int = 0
    ) -> list[Trajectory]:
        """Play ``rows``; group ids count on from ``first_group`` (the rows' place in the
        whole batch)."""
        self.worker.model.eval()
        with fsdp.gathered(self.worker.model), merged_for_rollouts(self.worker.model):
            trajs = play(self.engine, rows, settings, seed=seed)
        for t in trajs:
            t.group_id += first_group
        return trajs

    def update(self, share: TrainingBatch, settings: PPOSettings) -> dict[str, float]:
        """PPO on this worker's share; ``settings.mini_batch_size`` is the per-worker share."""
        return self.worker.train_batch(share, settings)

    @property
    def sharded(self) -> bool:
        return fsdp.is_sharded(self.worker.model)

    def state_dict(self) -> dict[str, Any]:
        """The group's state on rank 0 (with whole tensors); an empty dict on the others."""
        if self.rank and not self.sharded:
            return {}  # every rank holds the same: spare the copy
        return self.worker.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.worker.load_state_dict(state)

    @torch.no_grad()
    def trainable_fingerprint(self) -> float:
        """A position-weighted sum of the replicated trainable weights: equal on workers in
        step (``fsdp.replicated`` says why sharded ones are left out)."""
        weights = fsdp.replicated(self._trainable())
        if not weights:
            return 0.0
        return float(sum(p.double().sum() * (i + 1) for i, p in enumerate(weights)).item())

    def export(self, path: str | Path) -> None:
        """Rank 0 writes the policy and its processor to ``path``."""
        if self.rank and not self.sharded:
            return
        self.worker.save_pretrained(path)
        if self.rank == 0:
            write_companion_files(self.worker.model, self.worker.chat.processor, path)

    def sft_step(self, demos: Sequence[Any], micro_batch_size: int) -> dict[str, float]:
        """One SFT optimizer step on this worker's share of the batch (summed gradients)."""
        return self.worker.sft_step(demos, micro_batch_size)

    def with_policy(self, fn: Any, *args: Any) -> Any:
        """``fn(model, chat, *args)`` on the whole current weights (SFT's evaluation and
        DAgger episodes)."""
        self.worker.model.eval()
        with fsdp.gathered(self.worker.model):
            return fn(self.worker.model, self.worker.chat, *args)

    def write_policy(self, path: str | Path) -> None:
        """Rank 0 writes the policy with LoRA merged in, and its processor: a standard
        Hugging Face directory (``clew.models.hf_export``)."""
        if self.rank and not self.sharded:
            return
        self.worker.save_pretrained(path, merged=True)
        if self.rank == 0:
            write_companion_files(self.worker.model, self.worker.chat.processor, path)

    def close(self) -> None:
        self.sync.close()
