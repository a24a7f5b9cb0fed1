"""The engine-against-trainer logprob guard of a PPO update (``clew.algorithms.logprob_gap``).

Every update reports how far the logprobs the engine sampled the rollout with are from the
trainer's own forward on the same tokens, measured where the trainer's logprobs come for
free:

- with ``recompute_old_logprobs`` or ``use_tis``, the worker scores the whole batch before
  the update (the new PPO "old" logprobs), and the guard covers every loss-mask token;
- otherwise the first mini-batch's forward passes of the update are the trainer's forward
  on the sampling weights (no optimizer step has been taken yet), and the guard covers that
  mini-batch's tokens, at no extra forward. Those passes run in training mode: with LoRA
  dropout the guard includes the dropout's noise (``recompute_old_logprobs`` measures
  without it).

A data-parallel worker sums counts over the workers (``GradSync.total``), so each reports
the group's mean and share; the largest difference is its own, and the group takes the
largest of those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from clew.algorithms.logprob_gap import LogprobGap
from clew.train.model_batch import ModelBatch, SequenceLike, target_values
from clew.train.objectives import Objective, TargetOutputs

__all__ = ["gap_of_scores", "guard_metrics", "observing"]


def gap_of_scores(
    sequences: Sequence[SequenceLike], values: Mapping[str, Sequence[Tensor]]
) -> LogprobGap:
    """The gap over every sequence when ``values`` hold the trainer's scores
    (``old_logprobs``) beside the engine's (``rollout_logprobs``); empty otherwise."""
    gap = LogprobGap()
    if "rollout_logprobs" not in values:
        return gap
    trainer, engine, mask = [], [], []
    for seq, old, rollout in zip(
        sequences, values["old_logprobs"], values["rollout_logprobs"], strict=True
    ):
        n = len(seq.token_ids)
        trainer.append(target_values(old, n, "old_logprobs"))
        engine.append(target_values(rollout, n, "rollout_logprobs"))
        mask.append(torch.as_tensor(seq.loss_mask[1:], dtype=torch.float32))
    if trainer:
        gap.add(torch.cat(trainer), torch.cat(engine), torch.cat(mask))
    return gap


def observing(objective: Objective, gap: LogprobGap | None) -> Objective:
    """``objective``, also adding each micro-batch's ``|trainer - engine|`` to ``gap``: the
    forward's logprobs against the batch's ``old_logprobs`` (the engine's when not
    recomputed). ``gap`` None: ``objective`` itself."""
    if gap is None:
        return objective

    def observed(batch: ModelBatch, out: TargetOutputs) -> tuple[Tensor, dict[str, Tensor | float]]:
        trainer = out.per_target.detach()
        gap.add(trainer, batch.values["old_logprobs"], batch.target_mask)
        return objective(batch, out)

    return observed


def guard_metrics(gap: LogprobGap, total: Callable[[float], float] | None) -> dict[str, float]:
    """``policy/logprob_diff_*`` of ``gap``, summed over the workers through ``total`` (a
    worker's ``sync.total``; None: one worker)."""
    return (gap if total is None else gap.summed(total)).metrics("policy/")
