"""The losses a training micro-batch is reduced to: PPO (with KL and entropy terms) and SFT.

An objective sees one micro-batch and the policy's outputs at its loss-mask targets, and
returns the loss *reduced over that micro-batch* plus token-mean statistics. The worker
weights each micro-batch by its share of the mini-batch (see ``PolicyWorker.accumulate``),
so an objective never needs to know how the mini-batch was split.

The statistics are detached 0-dim tensors on the device (a float is accepted too), never
read back to the host here: the worker reads a mini-batch's in one copy at its end, so the
host need not wait for the device after each micro-batch's forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from clew.algorithms import compute_policy_loss, entropy_from_logits, kl_loss, reduce_loss
from clew.train.model_batch import ModelBatch, Vision, to_device
from clew.train.settings import PPOSettings


@dataclass
class TargetOutputs:
    """The policy at the K loss-mask targets of a micro-batch (row-major order).

    Either the whole ``logits`` are there, or (logprobs computed chunk by chunk,
    ``clew.models.token_logprobs``) they are None and ``entropy`` and ``greedy`` stand in
    for what an objective would read from them.
    """

    logits: Tensor | None  # Float[K, V], banned ids at -inf, not divided by the temperature
    logprobs: Tensor  # Float[K]
    per_target: Tensor  # Float[B, L - 1]: logprobs scattered back, 0 off the mask
    targets: Tensor  # Long[K]
    entropy: Tensor | None = None  # Float[K] at the sampling temperature
    greedy: Tensor | None = None  # Long[K]: the most likely id

    def entropies(self, temperature: float) -> Tensor:
        """Float[K]: each target's distribution's entropy at ``temperature``."""
        if self.entropy is not None:
            return self.entropy
        if self.logits is None:
            raise ValueError("these outputs hold neither logits nor entropies")
        return entropy_from_logits(self.logits[None], temperature=temperature)[0]

    def greedy_ids(self) -> Tensor:
        """Long[K]: the most likely id at each target."""
        if self.greedy is not None:
            return self.greedy
        if self.logits is None:
            raise ValueError("these outputs hold neither logits nor greedy ids")
        return self.logits.detach().argmax(-1)


Objective = Callable[[ModelBatch, TargetOutputs], tuple[Tensor, dict[str, Tensor | float]]]
"""``(batch, outputs) -> (loss, stats)``; stats are detached 0-dim tensors (or floats)."""


def ppo_objective(settings: PPOSettings) -> Objective:
    """Policy loss, plus ``kl_loss_coef * KL`` when the batch has ``ref_logprobs``, minus
    ``entropy_loss_coef * entropy``; all under ``settings.loss_reduction``."""

    def objective(batch: ModelBatch, out: TargetOutputs) -> tuple[Tensor, dict[str, Tensor]]:
        logprobs = out.per_target
        dev = logprobs.device
        mask = to_device(batch.target_mask, dev)
        reduction = {"reduction": settings.loss_reduction, "max_seq_len": settings.max_seq_len}
        tis = {}
        if settings.use_tis:  # old_logprobs are the trainer's; rollout_logprobs the engine's
            tis = {
                "rollout_logprobs": to_device(batch.values["rollout_logprobs"], dev),
                "tis_imp_ratio_cap": settings.tis_imp_ratio_cap,
            }
        loss, pg = compute_policy_loss(
            settings.policy_loss,
            logprobs,
            to_device(batch.values["old_logprobs"], dev),
            to_device(batch.values["advantages"], dev),
            mask,
            **settings.loss_options,
            **tis,
            **reduction,
        )
        stats = {"clip_fraction": pg["clip_fraction"], "approx_kl": pg["approx_kl"]}
        stats |= {k: pg[k] for k in ("tis_weight_mean", "tis_capped_fraction") if k in pg}
        if "ref_logprobs" in batch.values:
            ref = to_device(batch.values["ref_logprobs"], dev)
            kl = kl_loss(logprobs, ref, mask, settings.kl_estimator, **reduction)
            loss = loss + settings.kl_loss_coef * kl
            stats["kl_loss"] = kl.detach()
        bonus = settings.entropy_loss_coef != 0
        # Without a bonus the entropy is only a metric: keep it out of the autograd graph.
        with contextlib.nullcontext() if bonus else torch.no_grad():
            entropy = out.entropies(settings.temperature)
        metric = entropy.detach()
        stats["entropy"] = metric.mean() if metric.numel() else metric.new_zeros(())
        if bonus:
            per_target = torch.zeros_like(logprobs).masked_scatter(mask > 0, entropy)
            loss = loss - settings.entropy_loss_coef * reduce_loss(per_target, mask, **reduction)
        return loss, stats

    return objective


def sft_objective(batch: ModelBatch, out: TargetOutputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Cross-entropy of the loss-mask tokens (token mean), and greedy token accuracy (a
    detached 0-dim tensor)."""
    accuracy = (out.greedy_ids() == out.targets).float().mean().detach()
    return -out.logprobs.mean(), {"token_accuracy": accuracy}


@dataclass(frozen=True)
class GradientPass:
    """How one mini-batch's gradient is made, beside its sequences (``PolicyWorker.accumulate``).

    ``by_tokens``: each micro-batch's loss is scaled by its share of loss-mask tokens
    (``token_mean``), else by its share of sequences. ``pack``: the mini-batch's sequences
    packed into rows, a micro-batch being ``micro_batch_size`` packed rows. ``values``: the
    per-token values the objective reads (``clew.train.ppo_update.ppo_inputs``); ``vision``:
    the sequences' images as ``PolicyWorker.vision`` encodes them.
    """

    objective: Objective
    vision: Sequence[Vision]
    micro_batch_size: int
    values: Mapping[str, Sequence[Tensor]] = field(default_factory=dict)
    temperature: float = 1.0
    by_tokens: bool = True
    pack: bool = False
    allowed: tuple[str, ...] = ()
