"""One attention call for all the images of a batch when they share a size.

transformers' Qwen2-VL and Qwen3-VL vision towers attend image by image unless flash
attention is installed (clew does not require it): the packed patches are split
at ``cu_seqlens`` and each image gets its own attention call, in every vision layer. An
SFT step of 64 maze episodes held 912 frames, so 3,654 separate calls (forward alone),
each too small to use the GPU. Maze frames
all have one size, so the split pieces stack into one ``[images, heads, patches, dim]``
batch and one ``scaled_dot_product_attention`` call computes the same attention.

``batch_vision_attention(model)`` wraps the ``forward`` of each vision attention module
with that path and keeps the original for anything else (images of different sizes, or a
module whose layout this code does not recognise: it then leaves the model alone). The
result equals the per-image path up to float rounding (tested).
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["batch_vision_attention", "share_vision_positions"]


def _rotary_for(module: torch.nn.Module) -> Callable | None:
    """The vision rotary of ``module``'s transformers file, looked up at each call (so a
    replacement such as ``clew.kernels.fused_pointwise``'s is the one that runs)."""
    try:
        lib = importlib.import_module(type(module).__module__)
    except ImportError:  # pragma: no cover - the module's own file always imports
        return None
    if getattr(lib, "apply_rotary_pos_emb_vision", None) is None:
        return None
    return lambda *args: lib.apply_rotary_pos_emb_vision(*args)


def _length_range(cu_seqlens: torch.Tensor, lengths: torch.Tensor) -> tuple[int, int]:
    """The shortest and longest image of ``cu_seqlens``, read to the host once: the vision
    tower hands every layer the same ``cu_seqlens`` tensor, and each read waits for the
    device (on a GPU 27 waits a forward at Qwen3-VL-8B's depth, each leaving the device idle
    while the host queues the next kernels)."""
    known = getattr(cu_seqlens, "_clew_length_range", None)
    if known is None:
        known = tuple(int(x) for x in torch.aminmax(lengths))
        cu_seqlens._clew_length_range = known
    return known


def _batched_forward(rotary: Callable) -> Callable:
    def forward(
        self: torch.nn.Module,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *args: Any,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if args or position_embeddings is None:
            # The class's own forward, not a bound method kept from wrapping time: a deepcopy
            # of the model (the KL reference) must run its own weights.
            return type(self).forward(
                self,
                hidden_states,
                cu_seqlens,
                *args,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        # One image's length is the sequence's, known without a read (and a read would stop
        # a CUDA-graph capture of the tower: clew.inference.vision_graphs).
        one = len(lengths) == 1
        low, high = (hidden_states.shape[0],) * 2 if one else _length_range(cu_seqlens, lengths)
        if low != high:
            return type(self).forward(
                self, hidden_states, cu_seqlens, position_embeddings=position_embeddings, **kwargs
            )
        seq, images, heads = hidden_states.shape[0], len(lengths), self.num_heads
        q, k, v = self.qkv(hidden_states).reshape(seq, 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        q, k = rotary(q, k, cos, sin)

        def per_image(t: torch.Tensor) -> torch.Tensor:  # [S, H, D] -> [images, H, L, D]
            return t.reshape(images, low, heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            per_image(q), per_image(k), per_image(v), scale=self.scaling
        )
        return self.proj(out.transpose(1, 2).reshape(seq, -1))

    return forward


def batch_vision_attention(model: torch.nn.Module) -> int:
    """Wraps every recognised vision attention module of ``model``; returns how many."""
    visual = getattr(getattr(model, "model", model), "visual", None)
    if visual is None:
        return 0
    wrapped = 0
    for module in visual.modules():
        if not type(module).__name__.endswith("VisionAttention") or hasattr(
            module, "_clew_batched"
        ):
            continue
        implementation = str(getattr(getattr(module, "config", None), "_attn_implementation", ""))
        if "flash" in implementation:  # flash attention's varlen path is already one call
            continue
        rotary = _rotary_for(module)
        if rotary is None or not all(
            hasattr(module, a) for a in ("qkv", "proj", "num_heads", "scaling")
        ):
            continue
        module.forward = types.MethodType(_batched_forward(rotary), module)
        module._clew_batched = True
        wrapped += 1
    return wrapped


def _shared_positions_forward(merge: int, positions: Callable) -> Callable:
    cache: dict[tuple, torch.Tensor] = {}  # one image's ids by grid and device

    def forward(
        self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        grid = args[0] if args else kwargs.get("grid_thw")
        if (
            isinstance(grid, torch.Tensor)
            and grid.dim() == 2
            and len(grid) > 1
            and "position_ids" not in kwargs
            and bool((grid == grid[0]).all())
        ):
            key = (tuple(grid[0].tolist()), grid.device)
            if key not in cache:
                cache[key] = positions(grid[:1], merge)
            kwargs["position_ids"] = cache[key].repeat(len(grid), 1)
        return type(self).forward(self, hidden_states, *args, **kwargs)

    return forward


def share_vision_positions(model: torch.nn.Module) -> bool:
    """Wraps the vision tower's forward (see the module docstring); False if not recognised."""
    try:
        from transformers.vision_utils import get_vision_position_ids
    except ImportError:  # pragma: no cover - transformers older than clew supports
        return False
    visual = getattr(getattr(model, "model", model), "visual", None)
    merge = getattr(visual, "spatial_merge_size", None)
    if visual is None or not isinstance(merge, int) or hasattr(visual, "_clew_positions"):
        return False
    module = importlib.import_module(type(visual).__module__)
    if getattr(module, "get_vision_position_ids", None) is not get_vision_position_ids:
        return False  # this tower builds its positions some other way
    visual.forward = types.MethodType(
        _shared_positions_forward(merge, get_vision_position_ids), visual
    )
    visual._clew_positions = True
    return True
