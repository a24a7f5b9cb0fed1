"""Each distinct image of a forward through the vision tower once.

An agent's observations repeat within a batch: the samples of a GRPO prompt all start from
the same frame, a refused move shows the same frame again, and samples that made the same
moves see the same maze. A Qwen-VL vision tower's output for an image depends on that image
alone (its attention stays within each image's patches, ``cu_seqlens``), so for images of
one size the tower can run on one copy of each and its per-token outputs be gathered back to
every copy: the same values (up to the rounding of kernels sized by the batch), for the
tower's work on the distinct images only. vLLM keeps
an encoder cache by image hash for the same reason.

``dedup_vision_images(model)`` wraps the vision tower's ``forward``. Within
``images_deduplicated()`` (in this thread: every forward of the engine) a forward of
same-size images finds the copies and runs the tower on the first of each. Copies are found
by a signature of each image's patches (their product with two fixed random vectors, one
small product on the device, one read to the host) and confirmed element for element on the
device, so images share an output only where their patches are equal; were a confirmation to
fail, the tower runs on every image. Anything else (images of several sizes, an extra
per-token argument) goes to the tower unchanged. The trainer's forwards keep the tower as
transformers wrote it.

Within ``tower_runner(run)`` (in this thread) a forward of same-size images, its copies set
aside, goes to ``run`` instead, which may hand back the tower's output by other means: the
engine's vision graphs (``clew.inference.vision_graphs``) replay it by bucket of frames.

``IMAGES`` counts the images that came in and those the tower ran on.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import ModelOutput

from clew.kernels.thread_switch import ThreadSwitch

__all__ = [
    "IMAGES",
    "dedup_vision_images",
    "distinct_rows",
    "gathered",
    "images_deduplicated",
    "tower_runner",
]

_SWITCH = ThreadSwitch()  # on inside images_deduplicated() in this thread
_RUNNER = ThreadSwitch()  # this thread's tower_runner, if any
# (inner, tower, pixels, grid, flags) -> the tower's output, or None to run the tower itself
TowerRunner = Callable[[Callable, torch.nn.Module, torch.Tensor, torch.Tensor, dict], Any]
_CHUNK = 1 << 16  # columns of the signature's product at a time (a float32 copy of them)


@dataclass
class ImageCounts:
    """Images that reached a wrapped tower inside ``images_deduplicated()``, and those it
    ran on."""

    seen: int = 0
    encoded: int = 0

    def reset(self) -> None:
        self.seen = self.encoded = 0


IMAGES = ImageCounts()


def images_deduplicated(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within the block, in this thread, wrapped vision towers run each distinct image once."""
    return _SWITCH.block(enabled)


_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _weights(columns: int, device: torch.device) -> torch.Tensor:
    """float32 [columns, 2], fixed: the same signature for the same patches in every call."""
    key = (columns, device)
    if key not in _WEIGHTS:
        g = torch.Generator().manual_seed(0)
        _WEIGHTS[key] = torch.randn(columns, 2, generator=g).to(device)
    return _WEIGHTS[key]


def _signatures(flat: torch.Tensor) -> list[tuple[float, float]]:
    """Each row's product with the fixed weights, in float32, on the host."""
    w = _weights(flat.shape[1], flat.device)
    sig = torch.zeros(flat.shape[0], 2, dtype=torch.float32, device=flat.device)
    for c in range(0, flat.shape[1], _CHUNK):
        sig += flat[:, c : c + _CHUNK].float() @ w[c : c + _CHUNK]
    return [tuple(row) for row in sig.tolist()]


def distinct_rows(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(firsts, index)`` for rows ``flat`` [n, m]: ``flat[firsts]`` holds one row of each
    distinct value (the first), and ``flat[firsts][index]`` equals ``flat``. ``None`` where
    every row is distinct, or where rows with one signature differ (never yet seen)."""
    first: dict[tuple[float, float], int] = {}
    slot = [first.setdefault(s, len(first)) for s in _signatures(flat)]
    if len(first) == len(slot):
        return None
    firsts = [0] * len(first)
    for i, s in reversed(list(enumerate(slot))):
        firsts[s] = i
    copies = [i for i, s in enumerate(slot) if firsts[s] != i]
    originals = [firsts[slot[i]] for i in copies]
    if not torch.equal(flat[copies], flat[originals]):
        return None
    dev = flat.device
    return torch.tensor(firsts, device=dev), torch.tensor(slot, device=dev)


def gathered(out: Any, copies: int, index: torch.Tensor) -> Any:
    """``out`` of the tower over ``copies`` images, each per-token tensor in it gathered to
    the images of ``index`` (tensors, lists and tuples of them, and transformers' outputs)."""
    if isinstance(out, torch.Tensor):
        if out.dim() == 0 or out.shape[0] % copies:
            raise ValueError(f"a vision output of shape {tuple(out.shape)} is not per image")
        per = out.reshape(copies, out.shape[0] // copies, *out.shape[1:])
        return per[index].reshape(-1, *out.shape[1:])
    if isinstance(out, ModelOutput):
        return type(out)(**{k: gathered(v, copies, index) for k, v in out.items()})
    if isinstance(out, (list, tuple)):
        return type(out)(gathered(v, copies, index) for v in out)
    return out


@contextlib.contextmanager
def tower_runner(run: TowerRunner | None) -> Iterator[None]:
    """Within the block, in this thread, a forward whose images share one size goes to
    ``run(inner, tower, pixels, grid, flags)`` (after the copies are set aside; ``flags``: its
    other keyword arguments, none a tensor), which returns the tower's output or None to
    leave it to the tower (``clew.inference.vision_graphs``)."""
    with _RUNNER.block(run):
        yield


def _run_tower(inner: Callable, tower: torch.nn.Module, states: torch.Tensor, *args, **kwargs):
    """``inner(tower, states, *args, **kwargs)`` for same-size images and no tensor keyword
    argument, through this thread's runner where one is set."""
    run = _RUNNER.value
    if run is not None and len(args) <= 1:
        flags = {k: v for k, v in kwargs.items() if k != "grid_thw"}
        out = run(inner, tower, states, args[0] if args else kwargs["grid_thw"], flags)
        if out is not None:
            return out
    return inner(tower, states, *args, **kwargs)


def _dedup_forward(inner: Callable) -> Callable:
    """``inner``: the tower's forward before this wrapper, a plain function of ``self``, so a
    deep copy of the model (the KL reference) runs its own weights."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        grid = args[0] if args else kwargs.get("grid_thw")
        if not _SWITCH.on or not isinstance(grid, torch.Tensor) or grid.dim() != 2:
            return inner(self, hidden_states, *args, **kwargs)
        n = len(grid)
        IMAGES.seen += n
        extra = [k for k, v in kwargs.items() if k != "grid_thw" and isinstance(v, torch.Tensor)]
        uniform = not extra and hidden_states.shape[0] % n == 0 and bool((grid == grid[0]).all())
        found = distinct_rows(hidden_states.reshape(n, -1)) if uniform and n > 1 else None
        if found is None:
            IMAGES.encoded += n
            if uniform:
                return _run_tower(inner, self, hidden_states, *args, **kwargs)
            return inner(self, hidden_states, *args, **kwargs)
        firsts, index = found
        IMAGES.encoded += len(firsts)
        per = hidden_states.reshape(n, hidden_states.shape[0] // n, *hidden_states.shape[1:])
        states = per[firsts].reshape(-1, *hidden_states.shape[1:])
        if args:
            args = (grid[firsts], *args[1:])
        else:
            kwargs["grid_thw"] = grid[firsts]
        return gathered(_run_tower(inner, self, states, *args, **kwargs), len(firsts), index)

    return forward


def dedup_vision_images(model: torch.nn.Module) -> bool:
    """Wraps ``model``'s vision tower (see the module docstring); False if it has none."""
    visual = getattr(getattr(model, "model", model), "visual", None)
    if visual is None or hasattr(visual, "_clew_distinct"):
        return False
    inner = visual.forward.__func__  # the class's, or another wrapper's (share_vision_positions)
    visual.forward = types.MethodType(_dedup_forward(inner), visual)
    visual._clew_distinct = True
    return True
