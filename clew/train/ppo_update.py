"""One PPO update of a policy worker: its inputs, its mini-batches and epochs, its metrics.

The per-token values the PPO objective reads come first, once per batch: the engine's
logprobs and the advantages, with ``use_kl_loss`` the KL reference's logprobs, and with
``recompute_old_logprobs`` or TIS the trainer's own logprobs as PPO's "old" policy. Then
each epoch walks the mini-batches, accumulating each one's gradient over micro-batches
(``PolicyWorker.accumulate``) and taking one optimizer step. The engine-against-trainer
logprob guard (``clew.train.logprob_guard``) watches the first pass, while the weights are
still those the engine sampled with.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from clew.algorithms import LogprobGap
from clew.train.logprob_guard import gap_of_scores, guard_metrics, observing
from clew.train.micro_batches import micro_batches as chunked
from clew.train.model_batch import Vision
from clew.train.objectives import GradientPass, ppo_objective
from clew.train.settings import PPOSettings
from clew.train.training_batch import TrainingBatch

if TYPE_CHECKING:
    from clew.train.worker import PolicyWorker

__all__ = ["PPOInputs", "accumulate_ppo_gradients", "ppo_inputs", "train_ppo"]

# The per-token values of a batch the PPO objective reads, and its images.
PPOInputs = tuple[dict[str, Sequence[Tensor]], list[Vision]]


def ppo_inputs(worker: PolicyWorker, batch: TrainingBatch, settings: PPOSettings) -> PPOInputs:
    """The per-token values of ``batch`` the PPO objective reads, and its images; with
    ``use_kl_loss`` the reference's logprobs too (the KL reference: ``clew.train.worker``)."""
    values: dict[str, Sequence[Tensor]] = {
        "old_logprobs": batch.old_logprobs,
        "advantages": batch.token_advantages(),
    }
    if settings.use_kl_loss:
        values["ref_logprobs"] = worker.compute_logprobs(
            batch.sequences,
            settings.temperature,
            settings.forward_micro_batch_size,
            adapter_enabled=False,
            allowed=settings.allowed_tokens,
        )
    if settings.recompute_old_logprobs or settings.use_tis:
        # PPO's "old" policy becomes the trainer's forward; the engine's stay for TIS.
        values["rollout_logprobs"] = batch.old_logprobs
        values["old_logprobs"] = worker.compute_logprobs(
            batch.sequences,
            settings.temperature,
            settings.forward_micro_batch_size,
            allowed=settings.allowed_tokens,
        )
    return values, worker.vision(batch.sequences)


def _gradient(inputs: PPOInputs, settings: PPOSettings, gap: LogprobGap | None) -> GradientPass:
    values, vision = inputs
    return GradientPass(
        observing(ppo_objective(settings), gap),
        vision,
        settings.micro_batch_size,
        values,
        settings.temperature,
        by_tokens=settings.loss_reduction == "token_mean",
        allowed=settings.allowed_tokens,
    )


def accumulate_ppo_gradients(
    worker: PolicyWorker, batch: TrainingBatch, settings: PPOSettings
) -> dict[str, float] | None:
    """The PPO gradient of the whole ``batch`` as one mini-batch, left in ``.grad`` (no step)."""
    inputs = ppo_inputs(worker, batch, settings)
    return worker.accumulate(batch.sequences, range(len(batch)), _gradient(inputs, settings, None))


def train_ppo(
    worker: PolicyWorker, batch: TrainingBatch, settings: PPOSettings
) -> dict[str, float]:
    """PPO on ``batch`` as ``settings`` say: ``epochs`` passes, one optimizer step per
    mini-batch. Returns ``policy/*`` metrics, means over the optimizer steps, and the
    engine-against-trainer logprob guard (``clew.train.logprob_guard``)."""
    inputs = ppo_inputs(worker, batch, settings)
    gap = gap_of_scores(batch.sequences, inputs[0])
    watch = None if "rollout_logprobs" in inputs[0] else gap
    sizes = settings.mini_batch_sizes or [
        len(c) for c in chunked(range(len(batch)), settings.mini_batch_size or len(batch) or 1)
    ]
    if sum(sizes) != len(batch):
        raise ValueError(f"mini-batch sizes {list(sizes)} do not add up to {len(batch)}")
    bounds = [0, *itertools.accumulate(sizes)]
    steps: list[dict[str, float]] = []
    for _ in range(settings.epochs):
        for indices in (range(lo, hi) for lo, hi in itertools.pairwise(bounds)):
            stats = worker.accumulate(batch.sequences, indices, _gradient(inputs, settings, watch))
            if stats is not None:
                steps.append(stats | worker.optimizer_step())
                watch = None  # the weights are no longer those the engine sampled with
    keys = ("loss", "clip_fraction", "approx_kl", "kl_loss", "entropy", "grad_norm", "lr")
    keys += ("tis_weight_mean", "tis_capped_fraction") if settings.use_tis else ()
    out = {f"policy/{k}": _mean(steps, k) for k in keys}
    out |= guard_metrics(gap, None if worker.sync is None else worker.sync.total)
    out["policy/optimizer_steps"] = float(len(steps))
    out["policy/skipped_steps"] = sum(s["skipped"] for s in steps)
    return out


def _mean(rows: list[dict[str, float]], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else 0.0
