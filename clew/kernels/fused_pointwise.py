"""The rotary embeddings and the SwiGLU gate of a Qwen-VL policy, each as one fused kernel.

With the RMSNorms fused (``clew.kernels.fused_norm``), a Qwen-VL text layer still computes its
rotary embedding as ten element-wise kernels (for queries and for keys: a negation and a
concatenation for ``rotate_half``, two products, a sum) and its gate as two (SiLU, product).
In a decode step of the 8B preset replayed from a CUDA graph each of them is a launch over a
few hundred kilobytes, a third of the step's 30 or so kernels a layer; in a prefill each is a
whole pass over the activations. ``torch.compile`` (Inductor) turns each function into one
kernel that reads its inputs once and rounds once, in float32 inside.

Why compile two small functions rather than the model: transformers' layers run clew's
cache, attention and adapter hooks, which a whole-model graph would have to trace through;
a pure function of tensors compiles in seconds and cannot break on them. Why not a library
of fused kernels (Liger, vLLM's): neither is a dependency of clew, and both duplicate what
Inductor generates here.

The vision tower's rotary embedding is the same computation in float32 with four casts
around it (sixteen kernels a vision layer over every patch of the batch's frames); fused,
it reads the bf16 queries and keys once and writes them once.

``fuse_pointwise(model)`` gives the text MLPs whose activation is SiLU a forward that calls
the fused gate, and points the ``apply_rotary_pos_emb`` and ``apply_rotary_pos_emb_vision``
of transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL modules at functions that call the fused
rotaries. All of them take the fused path only inside ``pointwise_fused()`` (the engine's
forwards, with ``generator.inference_engine.fused_pointwise=true``) and on a device in
``COMPILE_DEVICES`` (CUDA); everywhere else, the trainer's forwards included,
transformers' own code runs as before.

A function compiles on its first fused call; a CUDA-graph decode step makes that call in
its warm-up run, before the capture. If that compilation fails (no Triton, no compiler), a
warning says so and the function stays eager. Each fused call costs some host time (the
compiled function's guards), which a replayed graph does not pay
and a prefill's large kernels hide; a decode step run eagerly (``enforce_eager=true``, rows
with their own adapters) would pay it in every layer, so the engine leaves the fused kernels
out of those (``clew.inference.cache_batch``).
"""

from __future__ import annotations

import contextlib
import importlib
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F

from clew.kernels.thread_switch import ThreadSwitch

__all__ = [
    "COMPILE_DEVICES",
    "fuse_pointwise",
    "pointwise_fused",
    "rotary",
    "rotary_vision",
    "silu_mul",
]

COMPILE_DEVICES: set[str] = {"cuda"}  # device types whose tensors take the fused kernels
ROTARY_MODULES = (
    "transformers.models.qwen2_vl.modeling_qwen2_vl",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "transformers.models.qwen3_vl.modeling_qwen3_vl",
)
MLP_CLASSES = frozenset({"Qwen2MLP", "Qwen2_5_VLMLP", "Qwen3VLTextMLP"})

_SWITCH = ThreadSwitch()  # on inside pointwise_fused() in this thread
_compiled: dict[str, Callable[..., Any]] = {}
_eager_only: set[str] = set()
calls: dict[str, int] = {}  # fused calls made, by kernel (tests, benchmarks)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` for Qwen-VL, the function compiled."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rotary_vision(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb_vision`` (in float32, back to the inputs' dtype),
    the function compiled."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    qf, kf = q.float(), k.float()
    q_embed = qf * cos + _rotate_half(qf) * sin
    k_embed = kf * cos + _rotate_half(kf) * sin
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU gate, ``silu(gate) * up``, the function compiled."""
    return F.silu(gate) * up


def pointwise_fused(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within the block, in this thread, fused models take the fused kernels."""
    return _SWITCH.block(enabled)


def _active(t: torch.Tensor) -> bool:
    return _SWITCH.on and t.device.type in COMPILE_DEVICES


@contextlib.contextmanager
def _no_duck_shapes() -> Iterator[None]:
    """Sizes that happen to be equal at a compilation (8 rows and 8 KV heads) stay separate
    symbols, so another row count does not compile the kernel again. A plain set and
    restore: ``fx_config.patch`` costs much more host time a call."""
    saved = fx_config.use_duck_shape
    fx_config.use_duck_shape = False
    try:
        yield
    finally:
        fx_config.use_duck_shape = saved


def _fused(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` through its compiled kernel; eager if its first compilation failed."""
    if name in _eager_only:
        return fn(*args)
    first = name not in _compiled
    compiled = _compiled.get(name) or torch.compile(fn, dynamic=True, fullgraph=True)
    try:
        with _no_duck_shapes():
            out = compiled(*args)
    except Exception as error:  # noqa: BLE001 - any backend failure: keep the eager function
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not first or capturing:
            raise
        warnings.warn(
            f"compiling the fused {name} kernel failed ({type(error).__name__}: {error}); "
            "it runs eagerly (generator.inference_engine.fused_pointwise=false avoids trying)",
            RuntimeWarning,
            stacklevel=3,
        )
        _eager_only.add(name)
        return fn(*args)
    _compiled[name] = compiled
    calls[name] = calls.get(name, 0) + 1
    return out


def _rotary_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # noqa: ANN001, ANN202
        if _active(q):
            return _fused("rotary", rotary, q, k, cos, sin, unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb._clew_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _vision_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_rotary_pos_emb_vision(q, k, cos, sin):  # noqa: ANN001, ANN202
        if _active(q):
            return _fused("rotary_vision", rotary_vision, q, k, cos, sin)
        return original(q, k, cos, sin)

    apply_rotary_pos_emb_vision._clew_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb_vision


def _mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if _active(gate):
        return self.down_proj(_fused("silu_mul", silu_mul, gate, up))
    return self.down_proj(self.act_fn(gate) * up)


def _patch_rotary() -> None:
    for module_name in ROTARY_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pragma: no cover - a transformers without this family
            continue
        for attr, dispatch in (
            ("apply_rotary_pos_emb", _rotary_dispatch),
            ("apply_rotary_pos_emb_vision", _vision_dispatch),
        ):
            fn = getattr(module, attr, None)
            if fn is not None and not hasattr(fn, "_clew_original"):
                setattr(module, attr, dispatch(fn))


def fuse_pointwise(model: torch.nn.Module) -> int:
    """Give ``model``'s SiLU text MLPs the fused gate and the Qwen-VL modules' rotary the
    fused path (both taken only inside ``pointwise_fused()``); returns how many MLPs."""
    _patch_rotary()
    fused = 0
    for module in model.modules():
        if type(module).__name__ not in MLP_CLASSES or hasattr(module, "_clew_pointwise"):
            continue
        act = getattr(module, "act_fn", None)
        if not isinstance(act, torch.nn.SiLU) and type(act).__name__ != "SiLUActivation":
            continue  # another activation: transformers' forward stays
        module.forward = types.MethodType(_mlp_forward, module)
        module._clew_pointwise = True
        fused += 1
    return fused
