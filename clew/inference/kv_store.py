"""KV-cache buffers kept from one engine batch for the next batch of the same shape.

A ``SlotCache`` allocates its key and value buffers when its first forward writes and drops
them with the batch. A CUDA graph records the addresses it reads, so graphs over a cache
(``clew.inference.prefill_graphs``) can only outlive the batch they were captured in if the
next batch writes into the very same buffers. A GRPO run opens one batch of the same rows
and capacity every step (and one for its evaluations), so with a ``KVStore`` the engine
hands a new cache the buffers its last cache of that shape used, zeroed, and the graphs
captured in an earlier step replay in every later one.

A set of buffers belongs to one live cache at a time (a weak reference to it): a cache that
asks for a shape another live cache holds gets new buffers. At most ``keep`` sets are kept
(the training batch's and the evaluation's); the least recently used one whose cache is gone
goes first. The cost: the buffers stay allocated between batches (during the policy update
of a GRPO step), which is why the engine keeps a store only where prefill graphs are on.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

Buffers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values
Shape = tuple[int, ...]


@dataclass
class _Set:
    buffers: Buffers
    owner: weakref.ref | None


class KVStore:
    """Per-layer key and value buffers by shape, lent to one cache at a time (docstring)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._sets: OrderedDict[tuple, _Set] = OrderedDict()
        self.reused = 0  # sets handed out again (tests, benchmarks)

    def buffers(
        self,
        owner: object,
        layers: int,
        keys: Shape,
        values: Shape,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Buffers:
        """``layers`` pairs of zeroed buffers of shapes ``keys`` and ``values``, lent to
        ``owner`` until it is gone or gives them back (``release``)."""
        key = (layers, tuple(keys), tuple(values), dtype, str(device))
        found = self._sets.get(key)
        if found is not None and (found.owner is None or found.owner() is None):
            found.owner = weakref.ref(owner)
            self._sets.move_to_end(key)
            for k, v in found.buffers:
                k.zero_()
                v.zero_()
            self.reused += 1
            return found.buffers
        made = [
            (
                torch.zeros(keys, dtype=dtype, device=device),
                torch.zeros(values, dtype=dtype, device=device),
            )
            for _ in range(layers)
        ]
        if found is None:  # a shape a live cache holds keeps its set; this one is not kept
            self._sets[key] = _Set(made, weakref.ref(owner))
            self._evict()
        return made

    def release(self, buffers: Buffers) -> None:
        """Give back a set (a cache that grew past it), for the next cache of its shape."""
        for entry in self._sets.values():
            if entry.buffers is buffers:
                entry.owner = None

    def clear(self) -> None:
        self._sets.clear()

    def _evict(self) -> None:
        while len(self._sets) > self.keep:
            free = [k for k, s in self._sets.items() if s.owner is None or s.owner() is None]
            if not free:
                return
            del self._sets[free[0]]
