"""The resumable sampler: walks the training rows in a seeded order, one batch per step.

Each epoch is a fresh permutation drawn from ``(seed, epoch)``, so the order depends only
on the seed and where the walk stands, and ``state_dict()`` (epoch, position) is all a
checkpoint needs to continue exactly. An incomplete last batch is dropped, as SkyRL's
dataloader does, so every step sees ``batch_size`` prompts. A position at the end of an
epoch is the start of the next one: a checkpoint taken on an epoch's last step resumes into
the next epoch, never an empty one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from clew.errors import ConfigError

T = TypeVar("T")


class ResumableSampler(Generic[T]):
    def __init__(self, rows: Sequence[T], batch_size: int, seed: int = 0, epochs: int = 1) -> None:
        if batch_size > len(rows):
            raise ConfigError(
                f"trainer.train_batch_size={batch_size} is larger than the {len(rows)} training "
                "rows; lower it or generate more rows"
            )
        self.rows = list(rows)
        self.batch_size = batch_size
        self.seed = seed
        self.epochs = epochs
        self.epoch = 0
        self.position = 0

    @property
    def batches_per_epoch(self) -> int:
        return len(self.rows) // self.batch_size

    @property
    def total_steps(self) -> int:
        return self.batches_per_epoch * self.epochs

    def state_dict(self) -> dict[str, Any]:
        """Where the walk stands: ``{"epoch": ..., "position": ...}``."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._roll_over()

    def _roll_over(self) -> None:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def __iter__(self) -> Iterator[list[T]]:
        while self.epoch < self.epochs:
            order = self._order(self.epoch)
            lo = self.position * self.batch_size
            batch = [self.rows[i] for i in order[lo : lo + self.batch_size]]
            self.position += 1
            self._roll_over()
            yield batch
