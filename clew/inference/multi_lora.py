"""Per-row LoRA adapters: rows of one engine batch running different adapters in one forward.

A merged adapter (``clew.train.lora.merged_for_rollouts``) serves one adapter per batch. Here
the base weights stay as they are and each target ``Linear`` of the language model is
replaced by a ``RowLoRALinear`` holding, besides the very same base weight and bias
parameters (so the model's ``state_dict`` and parameters do not change), the low-rank
factors of every loaded adapter stacked along a slot axis: ``lora_A [slots, r_max, in]`` and
``lora_B [slots, out, r_max]``, each adapter zero-padded to the largest loaded rank so
adapters of different ranks sit side by side, its scale (``lora_alpha / r``, or ``/ sqrt(r)``
for rsLoRA) folded into ``B``. Slot 0 is the bare base (zeros). A forward computes the base
matmul once for the whole batch and adds each row's update ``x @ A[s]^T @ B[s]^T`` from its
own adapter's slot ``s`` (as S-LoRA and Punica do).

The engine names each row's adapter and sets the rows of the next forward with
``MultiLoRA.rows`` (a prefill and a decode step alike: one adapter per row, every token of
the row); the wrapped layers read that plan, which is computed once per batch composition
and shared by every layer.

How the per-row updates are applied (``strategy``):

* ``grouped`` (the default): for each adapter present in the batch, its rows are picked with
  ``index_select``, run through that adapter's own ``A`` and ``B`` (sliced to its own rank,
  so the padding costs nothing) and added back with ``index_add_``; a batch whose rows all run
  one adapter does the two matmuls over the whole batch, with no indexing at all, and rows of
  the bare base cost nothing. Chosen because it copies no weights: its cost grows with the
  adapters present in a batch (a few, in serving), not with its rows.
* ``gather``: ``A[idx]`` and ``B[idx]`` per row and two ``bmm``s, one pair of kernels however
  many adapters, but a copy of ``rows x r_max x (in + out)`` adapter weights per layer per
  forward, which for 64 rows at rank 16 of an 8B Qwen (4096 wide) is 16 MiB per projection,
  and every row pays the largest rank. ``benchmarks/multi_lora.py`` compares the two.

Adapters are PEFT LoRA adapters (``adapter_config.json`` and ``adapter_model.safetensors``
as ``save_pretrained`` writes them), read from a folder or given as the config and tensors
already in memory. Only plain LoRA on ``Linear`` layers of the language model is taken:
DoRA, biases, ``modules_to_save``, embedding adapters, ``alpha_pattern`` and vision-tower
targets are refused with a ``ModelError`` saying so (vision patches belong to no batch row).
An adapter is checked whole before anything changes, so a bad one leaves the engine as it was.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from clew.errors import ConfigError, ModelError

STRATEGIES = ("grouped", "gather")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT's keys: ``base_model.model.<module>.lora_A[.<adapter>].weight`` (saved files drop the
# adapter name, a live model's state dict keeps it).
_KEY = re.compile(
    r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight"
)

AdapterSource = str | os.PathLike | tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]


def read_adapter(source: AdapterSource) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An adapter's config and tensors: from a PEFT adapter folder, or ``(config, tensors)``."""
    if isinstance(source, tuple):
        config, tensors = source
        return dict(config), dict(tensors)
    from safetensors.torch import load_file

    folder = Path(source)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise ModelError(
            f"{folder} is not a PEFT adapter folder: it needs {CONFIG_FILE} and {WEIGHTS_FILE} "
            "(only safetensors weights are loaded)"
        )
    try:
        config = json.loads(config_path.read_text())
        tensors = load_file(weights_path)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelError(f"cannot read the adapter at {folder}: {exc}") from exc
    return config, tensors


def _scale(config: Mapping[str, Any], rank: int) -> float:
    alpha = float(config.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _check_config(config: Mapping[str, Any]) -> None:
    refused = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "lora_bias": bool(config.get("lora_bias")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    bad = [key for key, is_bad in refused.items() if is_bad]
    if bad:
        shown = ", ".join(f"{key}={config.get(key)!r}" for key in bad)
        raise ModelError(
            f"per-row adapters take plain LoRA on Linear layers (peft_type 'LORA', no DoRA, "
            f"bias 'none', no modules_to_save, no alpha_pattern); this adapter has {shown}"
        )


@dataclass(frozen=True)
class _Plan:
    """Which rows of the next forward run which adapter slot."""

    rows: int
    groups: tuple[tuple[int, torch.Tensor | None], ...]  # (slot, row indices or None: all rows)
    slot_of_row: torch.Tensor | None  # [rows] slot per row (gather only)


class _Current:
    """The plan the wrapped layers read; one object shared by every layer of a model."""

    def __init__(self) -> None:
        self.plan: _Plan | None = None
        self.strategy = "grouped"


class RowLoRALinear(torch.nn.Linear):
    """A base ``Linear`` (same weight and bias parameters) plus every loaded adapter's factors,
    each row of a forward updated by its own adapter (module docstring)."""

    def __init__(self, base: torch.nn.Linear, current: _Current, slots: int, rank: int) -> None:
        torch.nn.Module.__init__(self)  # no fresh weights: the base's own are kept
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self._current = current
        w = base.weight
        self.register_buffer("lora_A", w.new_zeros(slots, rank, self.in_features), persistent=False)
        self.register_buffer(
            "lora_B", w.new_zeros(slots, self.out_features, rank), persistent=False
        )
        self.ranks = [0] * slots  # each slot's own rank here (0: the adapter skips this layer)

    def resize(self, slots: int, rank: int) -> None:
        """Room for ``slots`` adapters of rank up to ``rank`` (zero-padded), loaded ones kept."""
        old_a, old_b = self.lora_A, self.lora_B
        s, r = old_a.shape[0], old_a.shape[1]
        if (slots, rank) == (s, r):
            return
        a = old_a.new_zeros(slots, rank, self.in_features)
        b = old_b.new_zeros(slots, self.out_features, rank)
        a[: min(s, slots), : min(r, rank)] = old_a[:slots, :rank]
        b[: min(s, slots), :, : min(r, rank)] = old_b[:slots, :, :rank]
        self.lora_A, self.lora_B = a, b
        self.ranks = (self.ranks + [0] * slots)[:slots]

    def put(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Write one adapter's ``A [r, in]`` and scaled ``B [out, r]`` into ``slot`` (None: clear)."""
        self.lora_A[slot].zero_()
        self.lora_B[slot].zero_()
        self.ranks[slot] = 0
        if a is None or b is None:
            return
        r = a.shape[0]
        self.lora_A[slot, :r] = a.to(self.lora_A.dtype)
        self.lora_B[slot, :, :r] = b.to(self.lora_B.dtype)
        self.ranks[slot] = r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        plan = self._current.plan
        if plan is None:
            return y
        if x.dim() != 3 or x.shape[0] != plan.rows:
            raise RuntimeError(
                f"a per-row adapter layer got input {tuple(x.shape)} in a forward planned for "
                f"{plan.rows} rows: only the language model's [rows, tokens, features] inputs "
                "can carry per-row adapters"
            )
        if self._current.strategy == "gather":
            assert plan.slot_of_row is not None
            a = self.lora_A.index_select(0, plan.slot_of_row)  # [rows, r_max, in]
            b = self.lora_B.index_select(0, plan.slot_of_row)  # [rows, out, r_max]
            return y + torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2)).to(y.dtype)
        for slot, rows in plan.groups:
            r = self.ranks[slot]
            if r == 0:
                continue
            a, b = self.lora_A[slot, :r], self.lora_B[slot, :, :r]
            if rows is None:
                y = y + ((x @ a.T) @ b.T).to(y.dtype)
            else:
                y.index_add_(0, rows, ((x.index_select(0, rows) @ a.T) @ b.T).to(y.dtype))
        return y


class MultiLoRA:
    """The adapters a model holds for per-row use, by name; wraps target layers as needed."""

    def __init__(self, model: torch.nn.Module, strategy: str = "grouped") -> None:
        self.model = model
        self._current = _Current()
        self._plans: dict[tuple[str | None, ...], _Plan] = {}
        self.strategy = strategy
        self._layers: dict[str, RowLoRALinear] = {}
        self._slots: dict[str, int] = {}  # adapter name -> slot (0 is the bare base)
        self._free: list[int] = []
        self._num_slots = 1
        self._rank = 1

    @property
    def strategy(self) -> str:
        return self._current.strategy

    @strategy.setter
    def strategy(self, strategy: str) -> None:
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"per-row LoRA strategy {strategy!r} is unknown; choose one of "
                f"{', '.join(STRATEGIES)}"
            )
        self._current.strategy = strategy
        self._plans.clear()

    def names(self) -> list[str]:
        """The loaded adapters, in load order."""
        return list(self._slots)

    def add(self, name: str, source: AdapterSource) -> None:
        """Load adapter ``name`` from a PEFT adapter folder or ``(config, tensors)``."""
        if not isinstance(name, str) or not name:
            raise ModelError(f"an adapter name must be a non-empty string, got {name!r}")
        if name in self._slots:
            raise ModelError(f"adapter {name!r} is loaded already; remove it first to replace it")
        if hasattr(self.model, "peft_config"):
            raise ModelError(
                "per-row adapters go on a plain base model; this one is wrapped by peft (merge "
                "its adapter or serve the base it was trained on)"
            )
        config, tensors = read_adapter(source)
        factors = self._factors(name, config, tensors)
        slot = self._free.pop(0) if self._free else self._num_slots
        slots = max(self._num_slots, slot + 1)
        rank = max([self._rank] + [a.shape[0] for a, _ in factors.values()])
        modules = dict(self.model.named_modules())
        for module_name in factors:
            if module_name not in self._layers:
                self._wrap(module_name, modules[module_name])
        for layer in self._layers.values():
            layer.resize(slots, rank)
        self._num_slots, self._rank = slots, rank
        for module_name, layer in self._layers.items():
            a, b = factors.get(module_name, (None, None))
            layer.put(slot, a, b)
        self._slots[name] = slot
        self._plans.clear()

    def remove(self, name: str) -> None:
        """Unload adapter ``name``; rows naming it afterwards are refused."""
        slot = self._slots.pop(self._known(name))
        for layer in self._layers.values():
            layer.put(slot, None, None)
        self._free.append(slot)
        self._free.sort()
        self._plans.clear()

    def _known(self, name: str) -> str:
        """``name`` if loaded, else a ``ModelError`` listing the loaded adapters."""
        if name not in self._slots:
            loaded = ", ".join(self._slots) or "none"
            raise ModelError(f"no adapter {name!r} is loaded (loaded: {loaded})")
        return name

    def check_rows(self, adapters: list[str | None] | None, size: int) -> list[str | None]:
        """One adapter name (or None: the base) per row of a batch of ``size``."""
        if adapters is None:
            return [None] * size
        if len(adapters) != size:
            raise ConfigError(f"a batch of {size} rows needs {size} adapters, got {len(adapters)}")
        return [None if a is None else self._known(a) for a in adapters]

    @contextlib.contextmanager
    def rows(self, adapters: list[str | None]) -> Iterator[None]:
        """Within the block, row ``i`` of every forward runs adapter ``adapters[i]``."""
        self._current.plan = self._plan(adapters)
        try:
            yield
        finally:
            self._current.plan = None

    def _plan(self, adapters: list[str | None]) -> _Plan | None:
        key = tuple(adapters)
        if not any(a is not None for a in key):
            return None
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:
                self._plans.clear()
            plan = self._plans[key] = self._make_plan(key)
        return plan

    def _make_plan(self, adapters: tuple[str | None, ...]) -> _Plan:
        slots = [0 if a is None else self._slots[self._known(a)] for a in adapters]
        device = self._device()
        if self.strategy == "gather":
            slot_of_row = torch.tensor(slots, dtype=torch.long, device=device)
            return _Plan(len(slots), (), slot_of_row)
        groups: list[tuple[int, torch.Tensor | None]] = []
        for s in sorted(set(slots) - {0}):
            rows = [i for i, x in enumerate(slots) if x == s]
            index = None if len(rows) == len(slots) else torch.tensor(rows, device=device)
            groups.append((s, index))
        return _Plan(len(slots), tuple(groups), None)

    def _device(self) -> torch.device:
        return next(iter(self._layers.values())).weight.device

    def _wrap(self, name: str, module: torch.nn.Module) -> None:
        parent_name, _, child = name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        layer = RowLoRALinear(module, self._current, self._num_slots, self._rank)
        setattr(parent, child, layer)
        self._layers[name] = layer

    def _factors(
        self, name: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per target module, ``A [r, in]`` and ``B [out, r]`` times the scale, all checked."""
        _check_config(config)
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = _KEY.fullmatch(key)
            if match is None:
                raise ModelError(
                    f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a Linear "
                    "layer (embedding adapters, DoRA magnitudes and saved modules are refused)"
                )
            halves.setdefault(match["module"], {})[match["which"]] = tensor
        if not halves:
            raise ModelError(f"adapter {name!r} holds no LoRA weights")
        modules = dict(self.model.named_modules())
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for module_name, pair in sorted(halves.items()):
            layer = modules.get(module_name)
            if not isinstance(layer, torch.nn.Linear):
                known = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear)][:3]
                raise ModelError(
                    f"adapter {name!r} targets {module_name!r}, which is no Linear layer of the "
                    f"base model (its layers are named like {', '.join(known)})"
                )
            if ".visual." in f".{module_name}.":
                raise ModelError(
                    f"adapter {name!r} adapts the vision tower ({module_name}); per-row adapters "
                    "apply to the language model only (vision patches belong to no batch row)"
                )
            if set(pair) != {"A", "B"}:
                raise ModelError(f"adapter {name!r}: {module_name} lacks its lora_A or lora_B")
            a, b = pair["A"], pair["B"]
            r = a.shape[0]
            want_a, want_b = (r, layer.in_features), (layer.out_features, r)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise ModelError(
                    f"adapter {name!r}: {module_name} has lora_A {tuple(a.shape)} and lora_B "
                    f"{tuple(b.shape)}; the base layer needs {want_a} and {want_b}"
                )
            dev = layer.weight.device
            scaled = b.to(device=dev, dtype=torch.float32) * _scale(config, r)
            out[module_name] = (a.to(dev), scaled)
        return out
