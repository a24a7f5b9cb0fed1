"""AdamW, the learning-rate schedule and the clipped optimizer step of the policy worker."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from transformers import get_scheduler

from clew.errors import ConfigError
from clew.train.settings import SCHEDULERS, WorkerSettings


def build_optimizer(
    model: torch.nn.Module, settings: WorkerSettings
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the trainable parameters and its schedule (linear warmup, then the decay)."""
    if settings.scheduler not in SCHEDULERS:
        raise ConfigError(
            f"unknown scheduler {settings.scheduler!r}; accepted: {', '.join(SCHEDULERS)}"
        )
    if settings.scheduler != "constant_with_warmup" and not settings.num_training_steps:
        raise ConfigError(
            f"the {settings.scheduler!r} schedule needs num_training_steps (optimizer steps)"
        )
    # No weight decay on biases and norm scales (1-d): pulling them toward 0 only fights
    # the normalisation, as in most transformer recipes.
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ConfigError("the model has no trainable parameters")
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=settings.lr,
        betas=tuple(settings.adam_betas),
        weight_decay=settings.weight_decay,
    )
    scheduler = get_scheduler(
        settings.scheduler,
        optimizer,
        num_warmup_steps=settings.num_warmup_steps,
        num_training_steps=settings.num_training_steps,
    )
    return optimizer, scheduler


# Steps in a row with every optimizer step dropped (a non-finite gradient) before clew
# train or clew sft stops: the weights no longer change, so going on only burns device time.
MAX_DROPPED_STEPS = 3


def clipped_step(
    optimizer: torch.optim.Optimizer, scheduler: Any, max_grad_norm: float
) -> dict[str, float]:
    """Clip the gradient's global norm (off when <= 0), step, advance the schedule.

    A gradient whose norm is NaN or infinite is dropped instead: no optimizer step and no
    schedule step, so one bad batch cannot write NaN into every weight (as Megatron and
    DeepSpeed skip such steps). Returns the norm before clipping, the learning rate this
    step used, and ``skipped`` (1.0 when the step was dropped).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    limit = max_grad_norm if max_grad_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
    lr = float(optimizer.param_groups[0]["lr"])
    skipped = not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}


def to_cpu(obj: Any) -> Any:
    """A copy of a (nested) state dict with every tensor cloned to CPU."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
