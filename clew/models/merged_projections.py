"""A layer's query, key and value projections (and its MLP's gate and up) as one product each.

A Qwen-VL text layer multiplies the same input by three weights for its queries, keys and
values, and by two for its MLP's gate and up. In a decode step each product reads its
weight once for a few hundred rows, so five small products leave the matrix units idle
between them where two larger ones would not: one layer of the 8B preset was measured faster
with the products merged (``benchmarks/decode_linears.py``). vLLM
builds its models with merged projections (``QKVParallelLinear``,
``MergedColumnParallelLinear``); clew keeps transformers' models and merges them in place.
In a whole decode step most of that gain goes to copies of the merged product's strided
slices (the query and key norms want contiguous rows): a step gained little at large batches
and lost at smaller ones (BENCHMARKS.md), so the switch is off by default.

``merge_projections(model)`` lays each group's weights (and biases) out in one buffer, one
after the other along the output axis, and points each ``Linear``'s weight at its rows of
that buffer (``param.data``, so the ``Parameter`` objects, the ``state_dict`` and an
optimizer's state stay as they are, and no memory is added). The ``Linear``s become
``MergedLinear`` (a subclass, same forward): inside ``projections_merged()`` (the engine's
forwards, with ``generator.inference_engine.merged_projections=true``) the first of a group
called with an input computes the whole group's product, and each member returns its
columns of it; everywhere else (the trainer's forwards and their gradients included) each
``Linear`` computes its own product from its own weight, which is the same memory.

Why views rather than a merged copy: a copy of the 8B preset's merged weights is about 9 GB.
Why it stays correct when weights change: an optimizer step, a LoRA merge
(``clew.train.lora.merged_for_rollouts``) and a checkpoint load all write into the weights
in place, which is the buffer. A weight re-pointed at new memory (``param.data = ...``) is
found at the group's next merged product, copied back into the buffer and pointed at it again
(the buffer's address is kept: CUDA graphs captured over it stay valid), or, on another
device, dtype or shape, the group goes back to separate products for good.

Saving: safetensors refuses tensors that share memory, and ``save_pretrained`` would drop
them, so a merged model is saved through ``saveable_state_dict`` (the members copied apart).
A ``copy.deepcopy`` of a merged model (a merged export's) needs nothing: it clones each
``Parameter`` on its own, and its members take separate products.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from clew.errors import ConfigError
from clew.kernels.thread_switch import ThreadSwitch

# Which modules hold which group of projections of one input (Qwen2-VL, Qwen2.5-VL and
# Qwen3-VL text layers; Qwen2.5-VL's vision MLPs too).
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

_SWITCH = ThreadSwitch()  # on inside projections_merged() in this thread


def projections_merged(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within the block, in this thread, merged groups compute one product each."""
    return _SWITCH.block(enabled)


class _Group:
    """One buffer of weights (and biases) and the ``MergedLinear``s that are views of it."""

    def __init__(self, members: list[torch.nn.Linear]) -> None:
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.starts = [sum(self.sizes[:i]) for i in range(len(members))]
        with torch.no_grad():
            self.weight = torch.cat([m.weight.detach() for m in members])
            has_bias = members[0].bias is not None
            self.bias = torch.cat([m.bias.detach() for m in members]) if has_bias else None
        self.broken = False  # the members moved off the buffer's device, dtype or shape
        self._local = threading.local()  # the pending product, per thread
        self._point()

    def __deepcopy__(self, memo: dict) -> _Group:
        """A copy of the model (an export's) takes separate products: ``deepcopy`` clones
        each ``Parameter`` apart from the buffer, so a copied buffer would be read by none."""
        copy = _Group.__new__(_Group)
        copy.members, copy.sizes, copy.starts = [], self.sizes, self.starts
        copy.weight = copy.bias = None  # type: ignore[assignment]
        copy.broken, copy._local = True, threading.local()
        return copy

    def _point(self) -> None:
        """Each member's weight (and bias) its rows of the buffer."""
        for m, start, size in zip(self.members, self.starts, self.sizes, strict=True):
            m.weight.data = self.weight[start : start + size]
            if self.bias is not None:
                m.bias.data = self.bias[start : start + size]

    def _intact(self) -> bool:
        """Whether every member still reads its rows of the buffer; repairs what can be."""
        if self.broken:
            return False
        base, step = self.weight.data_ptr(), self.weight.stride(0) * self.weight.element_size()
        fine = all(
            m.weight.data_ptr() == base + start * step
            and (
                self.bias is None
                or m.bias.data_ptr() == self.bias.data_ptr() + start * self.bias.element_size()
            )
            for m, start in zip(self.members, self.starts, strict=True)
        )
        if fine:
            return True
        same = all(
            m.weight.device == self.weight.device
            and m.weight.dtype == self.weight.dtype
            and m.weight.shape == (size, self.weight.shape[1])
            for m, size in zip(self.members, self.sizes, strict=True)
        )
        if not same:
            self.broken = True
            return False
        with torch.no_grad():  # new values, same buffer: captured graphs read them too
            for m, start, size in zip(self.members, self.starts, self.sizes, strict=True):
                self.weight[start : start + size].copy_(m.weight.detach())
                if self.bias is not None:
                    self.bias[start : start + size].copy_(m.bias.detach())
        self._point()
        return True

    def columns(self, member: MergedLinear, x: torch.Tensor) -> torch.Tensor | None:
        """``member``'s output for ``x``: its columns of the group's product, computed by the
        group's first member called with ``x``; None when the group cannot merge, or when
        a gradient must reach the members' own weights (the buffer is not a parameter)."""
        if member.weight.requires_grad and torch.is_grad_enabled():
            return None
        local = self._local
        if getattr(local, "x", None) is not x:
            if not self._intact():
                return None
            local.x, local.y, local.left = x, F.linear(x, self.weight, self.bias), len(self.sizes)
        i = member._clew_index
        out = local.y[..., self.starts[i] : self.starts[i] + self.sizes[i]]
        local.left -= 1
        if local.left == 0:  # every member has its columns: let the product go
            local.x = local.y = None
        return out


class MergedLinear(torch.nn.Linear):
    """A ``Linear`` whose weight is a view of its group's buffer (module docstring)."""

    _clew_group: _Group
    _clew_index: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _SWITCH.on:
            out = self._clew_group.columns(self, x)
            if out is not None:
                return out
        return F.linear(x, self.weight, self.bias)


def _linear(module: torch.nn.Module | None) -> torch.nn.Linear | None:
    """The plain ``Linear`` under ``module`` (a PEFT LoRA layer's base layer), if any."""
    module = getattr(module, "base_layer", module)
    if type(module) in (torch.nn.Linear, MergedLinear):
        return module  # type: ignore[return-value]
    return None


def merge_projections(model: torch.nn.Module) -> int:
    """Merge every group of projections of one input in ``model`` (module docstring);
    returns how many groups are merged. Merging a merged model changes nothing."""
    merged = 0
    for module in list(model.modules()):
        for names in GROUPS:
            members = [_linear(getattr(module, n, None)) for n in names]
            if any(m is None for m in members):
                continue
            if all(isinstance(m, MergedLinear) for m in members):
                merged += 1
                continue
            w = [m.weight for m in members]
            if any(type(p.data) is not torch.Tensor for p in w):  # FSDP's DTensor shards
                raise ConfigError(
                    "generator.inference_engine.merged_projections=true needs whole weights; "
                    "trainer.strategy=fsdp shards them: set it to false"
                )
            same = {
                (p.device, p.dtype, p.shape[1], m.bias is not None)
                for p, m in zip(w, members, strict=True)
            }
            if len(same) != 1 or any(isinstance(m, MergedLinear) for m in members):
                continue
            group = _Group(members)  # type: ignore[arg-type]
            for i, m in enumerate(members):
                m.__class__ = MergedLinear
                m._clew_group, m._clew_index = group, i  # type: ignore[union-attr]
            merged += 1
    return merged


def merged_names(model: torch.nn.Module) -> set[str]:
    """The ``state_dict`` keys of ``model`` that are views of a merged group's buffer."""
    return {
        f"{name}.{p}"
        for name, m in model.named_modules()
        if isinstance(m, MergedLinear)
        for p in ("weight", "bias")
        if getattr(m, p) is not None
    }


def saveable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """``model.state_dict()`` with merged members copied apart on the CPU (for
    ``save_pretrained``); None when nothing in ``model`` is merged."""
    names = merged_names(model)
    if not names:
        return None
    state = model.state_dict()
    return {k: v.to("cpu", copy=True) if k in names else v for k, v in state.items()}
