"""Data-parallel policy workers: one rank of N, as a plain class.

``DataParallelWorker`` is one rank (the Ray actor of ``clew.cluster.ray_group`` wraps it):
it loads the policy, joins the process group (``clew.train.grad_sync``) and starts from
rank 0's trainable weights (LoRA adapters are initialised at random). It also plays
rollouts, colocated: an ``InferenceEngine`` samples from the very modules the rank trains
(a LoRA adapter merged while it samples), so every rank samples from the trained weights
after each step with nothing to copy.

With ``strategy`` ``fsdp`` (``fsdp2``), several ranks and full fine-tuning, each rank holds
a shard of the policy (``clew.train.fsdp``): it samples from the gathered weights, freed
again before the update, and the state and export methods are collectives that every rank
must join (rank 0 returns the state and writes the export; so it does without sharding).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from clew.data.rows import Row
from clew.errors import ModelError
from clew.inference.engine import EngineOptions
from clew.inference.runtime import limit_host_threads
from clew.metrics.progress import library_bars_off
from clew.models.hf_export import write_companion_files
from clew.rollout.loop import RolloutSettings, play
from clew.rollout.trajectory import Trajectory
from clew.train import fsdp
from clew.train.grad_sync import TorchDistributedSync
from clew.train.lora import merged_for_rollouts
from clew.train.settings import PPOSettings, WorkerSettings
from clew.train.training_batch import TrainingBatch
from clew.train.worker import PolicyWorker


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
