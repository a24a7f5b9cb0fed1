"""Sharding a fully fine-tuned policy over data-parallel workers with FSDP2.

``trainer.strategy=fsdp`` (or ``fsdp2``) with more than one worker and no LoRA: each worker
keeps only its shard of every weight, gradient and AdamW moment (``fully_shard`` on every
decoder layer, then on the root, which holds the embeddings, the output projection and the
vision tower). With LoRA the frozen base stays whole on every worker and only the adapter's
gradients travel, whatever the strategy; ``ddp`` always keeps whole copies.

Every forward and backward of a sharded layer is a collective of all workers (an all-gather
of its weights, a reduce-scatter of its gradients), so every worker must run the same
layers the same number of times. Decoder layers run in every pass; the vision tower runs
only for a micro-batch with images, and workers' micro-batches may differ there (a text
sequence, an empty share of a mini-batch), so the vision tower is not sharded block by
block but gathered with the root. Its weights are a small part of a Qwen-VL model's.
``lockstep`` has a worker that is done with its micro-batches run passes with no loss on a
two-token sequence until every worker is done.

Gradients: the workers' losses are already scaled by the mini-batch's global counts, so the
sum over workers is wanted, not FSDP's default mean: the divide factor is 1 and the
reduction a plain sum (which gloo can do too). A weight a pass did not use on a worker (the
vision tower's, on a text sequence) gets a zero gradient there (``all_weights``), so that
every worker reduce-scatters the same tensors, as the unsharded workers' all-reduce counts
a missing gradient as zeros. Every micro-batch is reduced as it goes rather than accumulated
unsharded over the mini-batch (``set_requires_gradient_sync``): that would hold a whole
unsharded gradient on every worker, the memory FSDP is there to save. Clipping over the
sharded gradients takes the global norm.

A forward that needs no gradient (rollouts, reference logprobs) runs on the ``gathered``
model: every weight all-gathered once and kept whole until the block ends, then freed, so
decoding does not all-gather each layer at every token, workers may run different numbers
of forwards inside, and the update that follows has the memory back.

State: ``full_state`` and ``load_full_state`` move the worker's weights and optimizer state
as whole tensors, in the format of an unsharded worker's ``state_dict``, so a checkpoint
written by sharded workers resumes on one worker and the reverse. The optimizer keeps
torch's own index-keyed state dict: ``torch.distributed.checkpoint``'s full optimizer state
dict would first take a zero-gradient step to create the state of an optimizer that has
none, changing AdamW's step count.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

from clew.errors import ClewError
from clew.train.optim import build_optimizer
from clew.train.worker_state import fitting_parameters

if TYPE_CHECKING:
    from clew.train.grad_sync import GradSync
    from clew.train.worker import PolicyWorker

try:  # FSDP2's public API (torch >= 2.6); older torch trains with whole copies only
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - depends on the installed torch
    FSDPModule = DTensor = None  # type: ignore[assignment,misc]

SHARDED_STRATEGIES = ("fsdp", "fsdp2")
STRATEGIES = (*SHARDED_STRATEGIES, "ddp", "none")

# Per sharded model: the names of the weights a pass may leave unused (see ``all_weights``).
_MAYBE_UNUSED: weakref.WeakKeyDictionary[torch.nn.Module, frozenset[str]] = (
    weakref.WeakKeyDictionary()
)
# The sharded models inside ``gathered`` now.
_GATHERED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def shards_policy(strategy: str, world_size: int, lora_rank: int) -> bool:
    """Whether ``world_size`` workers shard the policy (see the module docstring)."""
    if strategy not in STRATEGIES:
        raise ClewError(f"unknown strategy {strategy!r}; accepted: {', '.join(STRATEGIES)}")
    return strategy in SHARDED_STRATEGIES and world_size > 1 and lora_rank == 0


def is_sharded(module: torch.nn.Module) -> bool:
    return FSDPModule is not None and isinstance(module, FSDPModule)


def _is_sharded_tensor(t: Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: the modules of the language model whose classes the model names
    as units not to split (``_no_split_modules``, which also names the vision blocks)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = [m for m in decoder.modules() if type(m).__name__ in names]
    if not layers:
        raise ClewError(
            f"cannot shard {type(model).__name__} with FSDP: no decoder layer classes among "
            f"its _no_split_modules ({sorted(names)}); use trainer.strategy=ddp"
        )
    return layers


def _maybe_unused(model: torch.nn.Module, layers: Sequence[torch.nn.Module]) -> frozenset[str]:
    """The root's weights outside the language model and the output projection, which every
    pass uses: the vision tower's, in a Qwen-VL model."""
    always = set(map(id, itertools.chain.from_iterable(m.parameters() for m in layers)))
    for part in ("get_decoder", "get_output_embeddings"):
        module = getattr(model, part, lambda: None)()
        if module is not None:
            always |= set(map(id, module.parameters()))
    return frozenset(
        n for n, p in model.named_parameters() if p.requires_grad and id(p) not in always
    )


def _shard(model: torch.nn.Module, device: torch.device) -> None:
    if FSDPModule is None or not hasattr(FSDPModule, "set_gradient_divide_factor"):
        raise ClewError(
            f"trainer.strategy=fsdp needs FSDP2 with set_gradient_divide_factor (torch 2.8 "
            f"or later); this torch is {torch.__version__}: use trainer.strategy=ddp"
        )
    # The policy's logits come out as a view (only the kept positions are projected); FSDP
    # warns that an in-place op on it would skip a hook, but the worker makes none.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = _layers(model)
    _MAYBE_UNUSED[model] = _maybe_unused(model, layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    # The root's weights (embeddings, output projection) are needed again first in
    # backward: keep them gathered from forward to backward, as FSDP does by default.
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # else NCCL's premul-sum
                m.set_force_sum_reduction_for_comms(True)


def shard_worker(worker: PolicyWorker) -> None:
    """Shard ``worker``'s policy (and its frozen KL reference, if any) over the default
    process group and rebuild its optimizer over the shards. Before any optimizer step."""
    if worker.optimizer_steps:
        raise ClewError("the policy must be sharded before its first optimizer step")
    if worker.lora:
        raise ClewError("a LoRA policy is not sharded: its frozen base stays whole")
    _shard(worker.model, worker.device)
    if worker.reference is not None:
        _shard(worker.reference, worker.device)
    worker.optimizer, worker.scheduler = build_optimizer(worker.model, worker.settings)


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` with every weight whole for the block; resharded (the gathered copies
    freed) on the way out. A no-op for a model that is not sharded or already gathered (an
    inner block must not free what the outer one still uses). Every worker must enter it
    together; inside, forwards run without collectives."""
    units = [m for m in model.modules() if FSDPModule is not None and isinstance(m, FSDPModule)]
    if not units or model in _GATHERED:
        yield model
        return
    _GATHERED.add(model)
    for u in units:
        u.set_reshard_after_forward(False, recurse=False)
    try:
        handles = [u.unshard(async_op=True) for u in units]
        for h in handles:
            if h is not None:
                h.wait()
        yield model
    finally:
        _GATHERED.discard(model)
        for u in units:
            u.reshard()
            u.set_reshard_after_forward(u is not model, recurse=False)  # as _shard set it


def lockstep(plan: Sequence[list[int]], sync: GradSync) -> Iterator[list[int] | None]:
    """The micro-batches of ``plan``, then None (a pass with no loss) until every worker is
    done with its own. Every worker must call this together."""
    for k in itertools.count():
        mine = k < len(plan)
        if sync.total(float(mine)) == 0:
            return
        yield plan[k] if mine else None


def all_weights(model: torch.nn.Module) -> Tensor:
    """0 times the weights a pass may leave unused, to add to a sharded model's loss after its
    forward: each of them then gets a gradient (0 where unused) on every worker, so the root's
    reduce-scatter takes the same tensors everywhere (a worker with a text sequence and one
    with images). Read while the root's weights are gathered, from forward to backward."""
    names = _MAYBE_UNUSED.get(model, frozenset())
    weights = [p for n, p in model.named_parameters() if n in names]
    if not weights:
        return torch.zeros(())
    return torch.stack([w.sum() for w in weights]).sum() * 0.0


def zero_loss(logits: Tensor) -> Tensor:
    """A loss of 0 whose backward still runs through the whole model, and so through every
    sharded layer's reduce-scatter (masked logits are -inf, hence ``nan_to_num``)."""
    return logits.nan_to_num(0.0, posinf=0.0, neginf=0.0).sum() * 0.0


def replicated(params: Sequence[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters every worker holds whole: those whose gradients the workers must still
    sum themselves (FSDP has reduce-scattered the sharded ones in backward) and the only ones
    a desync fingerprint can compare (a sharded parameter exists once, its shards on
    different workers, so there is no copy to diverge)."""
    return [p for p in params if not _is_sharded_tensor(p)]


def _whole(t: Any, keep: bool) -> Any:
    """``t`` whole on CPU (None where not ``keep``); every worker must call it together."""
    if not isinstance(t, Tensor):
        return t
    full = t.full_tensor() if _is_sharded_tensor(t) else t
    return full.detach().to("cpu", copy=True) if keep else None


def full_state(worker: PolicyWorker, keep: bool) -> dict[str, Any]:
    """An unsharded worker's ``state_dict`` for a sharded one, on the workers that ``keep``
    it (an empty dict on the others). Every worker must call it together."""
    trainable = {n: _whole(p, keep) for n, p in worker.model.named_parameters() if p.requires_grad}
    optim = worker.optimizer.state_dict()
    # Sorted: the all-gathers of every worker must come in the same order.
    states = {
        i: {k: _whole(v, keep) for k, v in sorted(s.items())}
        for i, s in sorted(optim["state"].items())
    }
    if not keep:
        return {}
    return {
        "trainable": trainable,
        "optimizer": {"state": states, "param_groups": optim["param_groups"]},
        "scheduler": worker.scheduler.state_dict(),
        "optimizer_steps": worker.optimizer_steps,
    }


def full_model_state(model: torch.nn.Module, keep: bool) -> dict[str, Tensor]:
    """``model.state_dict()`` with whole tensors on CPU on the workers that ``keep`` it (an
    empty dict on the others), for ``save_pretrained``. Every worker must call it together."""
    whole = {k: _whole(v, keep) for k, v in model.state_dict().items()}
    return whole if keep else {}


def _shard_like(value: Any, param: Tensor) -> Any:
    """``value`` (whole) as this worker's shard of a tensor laid out like ``param``."""
    if not (isinstance(value, Tensor) and _is_sharded_tensor(param)):
        return value
    if value.shape != param.shape:  # a scalar such as AdamW's step
        return value
    # Every worker holds the whole tensor: each cuts its own shard, with no communication.
    return distribute_tensor(
        value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
    )


def load_full_state(worker: PolicyWorker, state: dict[str, Any]) -> None:
    """Load an unsharded worker's ``state_dict`` into a sharded worker."""
    trainable = state["trainable"]
    params = fitting_parameters(worker.model, trainable)
    with torch.no_grad():
        for n, t in trainable.items():
            params[n].copy_(_shard_like(t, params[n]))
    order = [p for g in worker.optimizer.param_groups for p in g["params"]]
    optim = state["optimizer"]
    sharded = {
        i: {k: _shard_like(v, order[i]) for k, v in s.items()} for i, s in optim["state"].items()
    }
    worker.optimizer.load_state_dict({"state": sharded, "param_groups": optim["param_groups"]})
    worker.scheduler.load_state_dict(state["scheduler"])
    worker.optimizer_steps = int(state.get("optimizer_steps", 0))
