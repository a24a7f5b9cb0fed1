"""What one PPO update learns from, as data: the boundary between a trainer and its workers.

A ``TrainingBatch`` carries sequences with the logprobs they were sampled with and their
advantages, nothing of the config; ``PPOSettings`` says how to learn from it. A worker
group hands each of its workers a share (``split``) and the worker spreads advantages onto
tokens itself (``token_advantages``), so no per-token tensor is built twice or shipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from clew.algorithms.step_advantages import turn_token_advantages
from clew.train.model_batch import SequenceLike


class SampledSequence(SequenceLike, Protocol):
    """A sequence with the sampler's logprob of each token (a rollout's ``Trajectory``)."""

    logprobs: list[float]


@dataclass(frozen=True)
class TrainingBatch:
    """``sequences`` (trajectories, or any ``SequenceLike``) and, one entry per sequence:

    ``advantages``: ``Float[N]`` (one per sequence, on each of its loss-mask tokens) or N
    tensors ``Float[T_i]`` (one per turn, on that turn's reply tokens, a turn being a run
    of 1s in the loss mask); ``old_logprobs``: the sampler's logprob of each token, token-
    or target-aligned (``clew.train.model_batch.target_values``).
    """

    sequences: Sequence[SequenceLike]
    advantages: Tensor | Sequence[Tensor]
    old_logprobs: Sequence[Tensor]

    def __post_init__(self) -> None:
        n = len(self.sequences)
        for name in ("advantages", "old_logprobs"):
            if (got := len(getattr(self, name))) != n:
                raise ValueError(f"a training batch of {n} sequences has {got} {name}")
        if any(a.dim() > 1 for a in self.advantages):
            raise ValueError(
                "advantages must be one number per sequence or one Float[T] per sequence "
                "(per turn); got a tensor of more than one dimension"
            )

    @classmethod
    def from_trajectories(
        cls, trajectories: Sequence[SampledSequence], advantages: Tensor | Sequence[Tensor]
    ) -> TrainingBatch:
        """Trajectories with the logprobs the engine sampled them with."""
        old = [torch.tensor(t.logprobs, dtype=torch.float32) for t in trajectories]
        return cls(list(trajectories), advantages, old)

    def __len__(self) -> int:
        return len(self.sequences)

    def token_advantages(self) -> list[Tensor]:
        """Per sequence, ``Float[L_i]``: each token's advantage, 0 off the loss mask."""
        out = []
        for adv, seq in zip(self.advantages, self.sequences, strict=True):
            adv = torch.as_tensor(adv, dtype=torch.float32)
            if adv.dim() == 1:
                out.append(turn_token_advantages(adv, seq.loss_mask))
            else:
                out.append(adv * torch.tensor(seq.loss_mask, dtype=torch.float32))
        return out

    def select(self, indices: Sequence[int]) -> TrainingBatch:
        """The sequences at ``indices``, in that order, with their own values."""
        idx = list(indices)
        adv = self.advantages
        return TrainingBatch(
            [self.sequences[i] for i in idx],
            adv[torch.tensor(idx, dtype=torch.long)]
            if isinstance(adv, Tensor)
            else [adv[i] for i in idx],
            [self.old_logprobs[i] for i in idx],
        )

    def split(self, parts: int, mini_batch_size: int | None = None) -> list[TrainingBatch]:
        """``parts`` shares for as many workers, each with its share of every mini-batch of
        ``mini_batch_size`` sequences (None: the whole batch), in order: mini-batch ``k`` of
        every share together is the batch's mini-batch ``k``, so workers that each step on
        their own mini-batch ``k`` with gradients summed take the one-worker steps. Shares
        of a mini-batch differ in size by at most one and may be empty
        (``share_sizes`` gives each share's mini-batch sizes).
        """
        sizes = share_sizes(len(self), mini_batch_size, parts)
        mini = mini_batch_size or len(self)
        shares = []
        for p in range(parts):
            idx = []
            for k, start in enumerate(range(0, len(self), mini)):
                lo = start + sum(sizes[q][k] for q in range(p))
                idx.extend(range(lo, lo + sizes[p][k]))
            shares.append(self.select(idx))
        return shares


def share_sizes(batch_size: int, mini_batch_size: int | None, parts: int) -> list[list[int]]:
    """For each of ``parts`` workers, the sizes of its share of every mini-batch of a batch
    of ``batch_size`` sequences (None: one mini-batch), in mini-batch order; the shares of
    a mini-batch differ by at most one, the first ones the larger."""
    mini = mini_batch_size or batch_size
    sizes: list[list[int]] = [[] for _ in range(parts)]
    for start in range(0, batch_size, mini):
        m = min(mini, batch_size - start)
        for p in range(parts):
            sizes[p].append(m // parts + (p < m % parts))
    return sizes
