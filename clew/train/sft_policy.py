"""The policy SFT trains, wherever it lives: one worker here or a group on Ray.

``SFTTrainer`` (``clew.train.sft``) needs five things of its policy: the chat format
(demonstrations are encoded in the driver), one optimizer step on a batch, a way to run a
function on the current weights (evaluation, DAgger's episodes), the exported policy, and
its state. ``LocalSFTPolicy`` gives them for a ``PolicyWorker`` in this process;
``clew.cluster.ray_group.RayWorkerGroup`` gives them for data-parallel workers, which take
the step one worker would take on the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from clew.data.rows import Row
from clew.inference.engine import EngineOptions
from clew.models.chat import ChatFormat
from clew.models.hf_export import write_companion_files
from clew.train.demonstrations import Demonstration
from clew.train.worker import PolicyWorker


class SFTPolicy(Protocol):
    """What SFT asks of the policy it trains: one worker here (``LocalSFTPolicy``) or a
    group of data-parallel workers (``clew.cluster.ray_group.RayWorkerGroup``)."""

    chat: ChatFormat

    def sft_step(self, demos: Sequence[Demonstration], micro_batch_size: int) -> dict[str, float]:
        """One optimizer step on ``demos`` (the whole batch, however it is spread)."""
        ...

    def with_policy(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(model, chat, *args)`` on the current weights, wherever they live."""
        ...

    def write_policy(self, directory: Path) -> None:
        """Full weights (LoRA merged in) and the processor: a standard Hugging Face
        directory (``clew.models.hf_export``), loadable by ``load_policy`` and by plain
        transformers."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class LocalSFTPolicy:
    """A ``PolicyWorker`` in this process as an ``SFTPolicy``; its state is the worker's."""

    def __init__(self, worker: PolicyWorker) -> None:
        self.worker = worker
        self.chat = worker.chat

    def sft_step(self, demos: Sequence[Demonstration], micro_batch_size: int) -> dict[str, float]:
        return self.worker.sft_step(demos, micro_batch_size)

    def with_policy(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.worker.model, self.worker.chat, *args)

    def write_policy(self, directory: Path) -> None:
        self.worker.save_pretrained(directory, merged=True)
        write_companion_files(self.worker.model, self.worker.chat.processor, directory)

    def state_dict(self) -> dict[str, Any]:
        return self.worker.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.worker.load_state_dict(state)


def play_policy(
    model: torch.nn.Module,
    chat: ChatFormat,
    rows: Sequence[Row],
    settings: Any,
    seed: int,
    autocast: bool,
    engine: EngineOptions | None = None,
) -> list[Any]:
    """``rows`` played by ``model`` (a ``with_policy`` function: DAgger's episodes), on an
    engine built with ``engine`` (``clew.rollout.loop.play_model``)."""
    from clew.rollout import play_model

    return play_model(model, chat, rows, settings, seed=seed, autocast=autocast, engine=engine)
