"""A policy worker's state (trainable weights, optimizer, schedule) and its exported weights.

The state holds the trainable weights only (the adapter, with LoRA) with the optimizer's
and the schedule's state, on CPU, in one format whether the policy is sharded or not
(``clew.train.fsdp`` gathers and cuts the tensors of a sharded one), so a checkpoint
resumes on any number of workers. ``fitting_parameters`` is the check both loaders run
before copying anything in.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from clew.errors import ClewError
from clew.models.hf_export import base_dir_of, export_dtype, read_base_files, save_weights
from clew.train import fsdp
from clew.train.optim import to_cpu

if TYPE_CHECKING:
    from clew.train.worker import PolicyWorker

__all__ = ["fitting_parameters", "load_worker_state", "save_policy", "worker_state"]


def fitting_parameters(
    model: torch.nn.Module, trainable: Mapping[str, Any]
) -> dict[str, torch.nn.Parameter]:
    """``model``'s parameters by name, once ``trainable`` (a worker state's weights) is known
    to name exactly its trainable ones: a state of other LoRA settings or another
    architecture is refused before any weight is overwritten."""
    params = dict(model.named_parameters())
    missing = sorted(n for n, p in params.items() if p.requires_grad and n not in trainable)
    unknown = sorted(n for n in trainable if n not in params)
    if missing or unknown:
        raise ClewError(
            "the worker state does not fit this model (different LoRA settings or "
            f"architecture?): missing {missing[:3]}, unexpected {unknown[:3]}"
        )
    return params


def worker_state(worker: PolicyWorker) -> dict[str, Any]:
    """Trainable weights (the adapter only, with LoRA), optimizer and scheduler, on CPU.

    A sharded policy's workers must all call this; worker 0 gets the state with whole
    tensors, the others an empty dict.
    """
    if fsdp.is_sharded(worker.model):
        return fsdp.full_state(worker, keep=_rank() == 0)
    return {
        "trainable": {
            n: p.detach().to("cpu", copy=True)
            for n, p in worker.model.named_parameters()
            if p.requires_grad
        },
        "optimizer": to_cpu(worker.optimizer.state_dict()),
        "scheduler": worker.scheduler.state_dict(),
        "optimizer_steps": worker.optimizer_steps,
    }


def load_worker_state(worker: PolicyWorker, state: dict[str, Any]) -> None:
    """Load a state written by ``worker_state`` (by a sharded policy or not) into ``worker``."""
    if fsdp.is_sharded(worker.model):
        fsdp.load_full_state(worker, state)
        return
    trainable = state["trainable"]
    params = fitting_parameters(worker.model, trainable)
    with torch.no_grad():
        for n, t in trainable.items():
            params[n].copy_(t)
    worker.optimizer.load_state_dict(state["optimizer"])
    worker.scheduler.load_state_dict(state["scheduler"])
    worker.optimizer_steps = int(state.get("optimizer_steps", 0))


def save_policy(worker: PolicyWorker, directory: str | Path, merged: bool = False) -> Path:
    """Save the adapter (LoRA) or the full model; ``merged`` writes LoRA merged into full weights.

    Full weights are written in the dtype of the checkpoint the policy was loaded from and
    sharded above 5 GB (``clew.models.hf_export``): a float32-trained policy over a bfloat16
    base exports as bfloat16, as the base loads. The adapter keeps its own tensors as peft
    writes them. Merging works on a copy (the worker keeps training its adapter), so it
    briefly needs a second model's memory. A sharded policy's workers must all call
    this; worker 0 writes the whole weights. The processor files are the caller's
    (``clew.models.hf_export.write_companion_files`` for a full-weight export).
    """
    directory = Path(directory)
    base = read_base_files(base_dir_of(worker.model))
    if fsdp.is_sharded(worker.model):
        whole = fsdp.full_model_state(worker.model, keep=_rank() == 0)
        if whole:
            dtype = export_dtype(worker.model, base)
            save_weights(worker.model, directory, dtype, state_dict=whole)
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    if worker.lora and merged:
        full = copy.deepcopy(worker.model).merge_and_unload()
        save_weights(full, directory, export_dtype(full, base), owned=True)
        del full
    elif worker.lora:
        worker.model.save_pretrained(directory)  # the adapter's own tensors
    else:
        save_weights(worker.model, directory, export_dtype(worker.model, base))
    return directory


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
