"""The worker-group interface the training loops drive, and its single-process form.

The loops never touch a model: GRPO asks a worker group to generate trajectories, to
update the policy from them, and to save or restore its state; SFT asks it for one step on
a batch of demonstrations, to run a function on the current weights (evaluation, DAgger's
episodes) and to write the policy. ``LocalWorkerGroup`` runs one plain ``PolicyWorker`` in
this process with the rollout engine sharing its weights;
``clew.cluster.ray_group.RayWorkerGroup`` runs several on Ray with the same methods, so
the loop does not change (``trainer.placement`` picks, ``clew.trainer.launch.build_worker_group``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from clew.data.rows import Row
from clew.envs.plugins import check_env_ids
from clew.inference.engine import EngineOptions, InferenceEngine
from clew.models.chat import ChatFormat
from clew.models.hf_export import write_companion_files
from clew.rollout.loop import RolloutSettings, play, play_model
from clew.rollout.trajectory import Trajectory
from clew.train.lora import merged_for_rollouts
from clew.train.model_batch import SequenceLike
from clew.train.settings import PPOSettings
from clew.train.training_batch import TrainingBatch
from clew.train.worker import PolicyWorker


class WorkerGroup(Protocol):
    """What the loop asks of its workers. ``update`` takes data and settings, never the
    config: a group of N workers hands each ``batch.split(N, settings.mini_batch_size)``
    with ``mini_batch_size`` divided by N, and combines their metrics. ``generate`` calls
    ``progress(n)`` as ``n`` more episodes finish (``clew.metrics.progress``).
    A group that cannot measure device memory may leave ``peak_memory_gb`` out.
    ``check_envs`` raises an ``EnvError`` unless every worker can build the envs of the
    ids given (``clew.envs.plugins``). SFT uses ``chat`` (demonstrations are encoded in
    the driver), ``sft_step``, ``with_policy`` and ``write_policy``, with the state
    methods."""

    world_size: int
    chat: ChatFormat

    def generate(
        self,
        rows: Sequence[Row],
        settings: RolloutSettings,
        seed: int,
        progress: Callable[[int], None] | None = None,
    ) -> list[Trajectory]: ...

    def update(self, batch: TrainingBatch, settings: PPOSettings) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def export(self, path: str | Path) -> None: ...

    def peak_memory_gb(self) -> float | None: ...

    def check_envs(self, env_ids: Sequence[str]) -> None: ...

    def shutdown(self) -> None: ...

    def sft_step(self, seqs: Sequence[SequenceLike], micro_batch_size: int) -> dict[str, float]:
        """One optimizer step on ``seqs`` (the whole batch, however it is spread)."""
        ...

    def with_policy(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(model, chat, *args)`` on the current weights, wherever they live."""
        ...

    def write_policy(self, directory: Path) -> None:
        """Full weights (LoRA merged in) and the processor: a standard Hugging Face
        directory (``clew.models.hf_export``), loadable by ``load_policy`` and by plain
        transformers."""
        ...


def peak_memory_gb(device: torch.device) -> float | None:
    """Peak memory tensors took on CUDA ``device`` since the previous call, in GB (10^9
    bytes); the call starts the next count. None off CUDA, where torch keeps no peak."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak / 1e9


class LocalWorkerGroup:
    """One policy worker in this process; the engine samples from the very modules it
    trains (built on first ``generate`` when none is given, as SFT needs none)."""

    world_size = 1

    def __init__(self, worker: PolicyWorker, engine: InferenceEngine | None = None) -> None:
        self.worker = worker
        self.chat = worker.chat
        self._engine = engine

    @property
    def engine(self) -> InferenceEngine:
        if self._engine is None:
            self._engine = InferenceEngine(self.worker.model, self.worker.chat)
        return self._engine

    def generate(
        self, rows: Sequence[Row], settings: RolloutSettings, seed: int, progress=None
    ) -> list[Trajectory]:
        self.worker.model.eval()
        # A LoRA policy samples with its adapter merged: one matmul a layer, not three
        with merged_for_rollouts(self.worker.model):
            return play(self.engine, rows, settings, seed=seed, progress=progress)

    def update(self, batch: TrainingBatch, settings: PPOSettings) -> dict[str, float]:
        """PPO updates on ``batch``; the one worker takes all of it."""
        return self.worker.train_batch(batch, settings)

    def state_dict(self) -> dict[str, Any]:
        return self.worker.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.worker.load_state_dict(state)

    def export(self, path: str | Path) -> None:
        """The inference-ready policy: the adapter (or full weights) plus processor files."""
        self.worker.save_pretrained(path)
        write_companion_files(self.worker.model, self.worker.chat.processor, path)

    def peak_memory_gb(self) -> float | None:
        """The worker's peak device memory since the previous call (``peak_memory_gb``)."""
        return peak_memory_gb(self.worker.device)

    def check_envs(self, env_ids: Sequence[str]) -> None:
        """The worker is this process: the ids must be registered here."""
        check_env_ids(env_ids)

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives and ends with this process."""

    def sft_step(self, seqs: Sequence[SequenceLike], micro_batch_size: int) -> dict[str, float]:
        return self.worker.sft_step(seqs, micro_batch_size)

    def with_policy(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.worker.model, self.worker.chat, *args)

    def write_policy(self, directory: Path) -> None:
        self.worker.save_pretrained(directory, merged=True)
        write_companion_files(self.worker.model, self.worker.chat.processor, directory)


def play_policy(
    model: torch.nn.Module,
    chat: ChatFormat,
    rows: Sequence[Row],
    settings: RolloutSettings,
    seed: int,
    autocast: bool,
    engine: EngineOptions | None = None,
) -> list[Trajectory]:
    """``rows`` played by ``model`` (a ``with_policy`` function: DAgger's episodes), on an
    engine built with ``engine`` (``clew.rollout.loop.play_model``)."""
    return play_model(model, chat, rows, settings, seed=seed, autocast=autocast, engine=engine)
