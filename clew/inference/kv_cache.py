"""The engine's in-place KV cache, ``SlotCache``.

``SlotCache`` is a transformers ``Cache``
whose layers are preallocated ``[slots, kv_heads, capacity, head_dim]`` buffers. A row of
the batch lives in one slot and has its own length (``fill``): a forward writes each row's
new keys and values at that row's next columns, in place (``index_put_``), and hands the
attention ``[rows, kv_heads, width, head_dim]`` views of the buffers, ``width`` being the
longest live row, so nothing is concatenated, padded or copied per step and the keys are
read as their KV heads are (``clew.inference.attention``). Which columns a row attends to
is a boolean ``visible`` table per slot: a column is visible once written and until its
image is hidden (``keep_last_k_images``); the attention mask of a forward is that table
(a view of it for a decode step) and, for a prefill, causality within the new chunk.

Rows live in slots ``[0, rows)``. A finished row frees its slot: the others stay where they
are, except that the last rows move down into the freed slots (a copy of those rows alone),
so a forward always runs over ``rows`` slots with no holes; the engine samples in the rows'
sequence order whatever their slots (``CacheBatch._sample``), so seeded draws do not depend
on where a row lives. Hidden image columns are removed within each row's slot (a gather of
the visible columns to the front) only once they are a quarter of the width. Chunk padding
(the batch's chunks are left-padded to one width) is written past each row's end, where the
next real token overwrites it, and is never visible; a packed prefill
(``prefill(packed=True)``) writes the real tokens alone. A row that joins a running batch
(``add_rows``) takes the next free slot, the slots doubling when none is left; a forward may
cover a range of slots only (``prefill(first=)``: the joining rows' prompts), attending over
views of those slots alone.

Capacity: a slot holds ``capacity`` columns; before a turn the engine asks for its longest
row plus the turn's growth (the longest chunk and every decode step) and the buffers grow
when that is more: to twice the old capacity or, under a budget, to ``capacity_hint`` (the
longest row the rollout loop expects), never past the budget. A growth copies the live part
once; a turn never does. The budget counts ``rows x (longest row + the turn's
growth)`` columns, the rows' real lengths rather than the longest a row could grow. With a
``store`` (``clew.inference.kv_store``) the buffers come from, and go back to, the engine's
store, so the next batch of the same shape writes into the same memory.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from clew.inference.kv_store import KVStore


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of KV cache one token takes across all layers."""
    cfg = model.config
    text = getattr(cfg, "text_config", cfg)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    elem = next(model.parameters()).element_size()
    return 2 * text.num_hidden_layers * heads * head_dim * elem


def cache_budget_bytes(
    device: torch.device, gpu_memory_utilization: float, max_cache_mb: int
) -> int:
    """The KV-cache budget: a share of the GPU's memory, or a fixed size on CPU.

    vLLM's meaning: the whole process may use ``gpu_memory_utilization`` of the device; the
    cache gets what the live tensors (weights, optimizer) leave of it, within what is free.
    Blocks torch's allocator holds but no tensor uses count as free: they are what an
    earlier phase or run of the same process (an SFT stage before GRPO, an update before
    the next rollout) left cached, and the cache's own allocations reuse them."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        live = torch.cuda.memory_allocated(device)
        cached = torch.cuda.memory_reserved(device) - live
        return max(0, min(free + cached, int(total * gpu_memory_utilization) - live))
    return max_cache_mb * 2**20


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values, ``[slots, kv_heads, capacity, head_dim]``."""

    is_sliding = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise NotImplementedError("SlotCache allocates its layers itself")

    def update(self, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("SlotCache.update writes the layers")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def get_max_length(self) -> int:
        return -1


class SlotCache(Cache):
    """The in-place KV cache of one engine batch (see the module docstring)."""

    def __init__(
        self,
        num_layers: int,
        rows: int,
        device: torch.device,
        *,
        bytes_per_token: int,
        budget_bytes: int | None = None,
        capacity_hint: int | None = None,
        store: KVStore | None = None,
    ) -> None:
        super().__init__(layers=[SlotLayer() for _ in range(num_layers)])
        # Where the buffers come from when kept between batches (clew.inference.kv_store).
        self.store = store
        self._lent: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.device = device
        self.rows = rows  # live rows, in slots [0, rows)
        self.slots = rows
        self.capacity = 0
        self.bytes_per_token = bytes_per_token
        self.budget_bytes = budget_bytes
        self.capacity_hint = capacity_hint
        self.fill = [0] * rows  # columns each row has written (host copy of fill_dev)
        self.fill_dev = torch.zeros(rows, dtype=torch.long, device=device)
        self.visible = torch.zeros(rows, 0, dtype=torch.bool, device=device)
        self.image_of_col = torch.zeros(rows, 0, dtype=torch.long, device=device)
        self.hidden_any = False
        # Bumped whenever the buffers move (a growth): CUDA graphs over them are then stale.
        self.generation = 0
        # Where the current forward writes: row and column indices [rows, T] (a packed
        # prefill's [1, tokens]), the width of the views the attention reads, and the first
        # slot and the number of the rows they cover.
        self._write: tuple[torch.Tensor, torch.Tensor, int, int, int] | None = None
        self._arange = torch.arange(rows, device=device)

    # What transformers calls.
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._write is None:
            raise RuntimeError("SlotCache: a forward ran without prefill()/decode() planning it")
        rows, cols, width, first, b = self._write
        layer = self.layers[layer_idx]
        if layer.keys is None:
            shape = (self.slots, key_states.shape[1], self.capacity, key_states.shape[3])
            if self.store is not None:  # every layer's at once, from the store
                self._allocate(shape, value_states.shape[3], key_states.dtype)
            else:
                layer.keys = key_states.new_zeros(shape)
                layer.values = value_states.new_zeros(shape[:3] + (value_states.shape[3],))
                layer.is_initialized = True
        # Advanced indices on dims 0 and 2 put their [B, T] first: [B, T, kv_heads, head_dim].
        layer.keys[rows, :, cols] = key_states.transpose(1, 2)
        layer.values[rows, :, cols] = value_states.transpose(1, 2)
        return layer.keys[first : first + b, :, :width], layer.values[first : first + b, :, :width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def _allocate(self, keys: tuple[int, ...], value_dim: int, dtype: torch.dtype) -> None:
        """Every layer's buffers from the store, giving back the ones they replace."""
        assert self.store is not None
        lent = self.store.buffers(
            self, len(self.layers), keys, keys[:3] + (value_dim,), dtype, self.device
        )
        if self._lent is not None:
            self.store.release(self._lent)
        self._lent = lent
        for layer, (k, v) in zip(self.layers, lent, strict=True):
            layer.keys, layer.values = k, v
            layer.is_initialized = True

    # What the engine calls.
    @property
    def width(self) -> int:
        """Columns the longest live row holds."""
        return max(self.fill[: self.rows], default=0)

    def buffers(self) -> list[torch.Tensor]:
        """Every allocated key and value buffer (their storage never moves between growths)."""
        return [
            t for layer in self.layers if layer.keys is not None for t in (layer.keys, layer.values)
        ]

    def fits(self, extra: int) -> bool:
        """Whether every row can grow by ``extra`` columns within the budget."""
        need = self.width + extra
        if need <= self.capacity or self.budget_bytes is None:
            return True
        return self.rows * need * self.bytes_per_token <= self.budget_bytes

    def fits_joining(self, n: int, tokens: int) -> bool:
        """Whether ``n`` more rows of ``tokens`` columns fit beside the live rows."""
        need = max(self.width, tokens)
        if self.budget_bytes is None or (self.rows + n <= self.slots and need <= self.capacity):
            return True
        return (self.rows + n) * need * self.bytes_per_token <= self.budget_bytes

    def add_rows(self, n: int) -> None:
        """``n`` empty rows in slots ``[rows, rows + n)``; the slots double when full, within
        the budget (a copy of the live rows, as a growth in columns)."""
        lo, rows = self.rows, self.rows + n
        if rows > self.slots:
            slots = max(rows, 2 * self.slots)
            if self.budget_bytes is not None and self.capacity:
                afford = self.budget_bytes // (self.capacity * self.bytes_per_token)
                slots = max(rows, min(slots, afford))
            self._resize(self.capacity, slots)
        # A freed slot still holds its last row's table entries.
        self.visible[lo:rows] = False
        self.image_of_col[lo:rows] = -1
        self.fill_dev = torch.cat([self.fill_dev, self.fill_dev.new_zeros(n)])
        self.fill += [0] * n
        self.rows = rows

    def reserve(self, need: int) -> None:
        """Make every slot hold at least ``need`` columns (see the module docstring)."""
        if need <= self.capacity:
            return
        # The hint only under a budget: without one it could ask for more than the device has.
        hint = (self.capacity_hint or 0) if self.budget_bytes is not None else 0
        target = -(-max(need, 2 * self.capacity, hint) // 16) * 16
        if self.budget_bytes is not None:
            afford = self.budget_bytes // max(1, self.rows * self.bytes_per_token)
            target = max(need, min(target, afford))
        self._resize(target)

    def _resize(self, capacity: int, slots: int | None = None) -> None:
        rows, width = self.rows, self.width
        slots = rows if slots is None else slots
        visible = torch.zeros(slots, capacity, dtype=torch.bool, device=self.device)
        image = torch.full((slots, capacity), -1, dtype=torch.long, device=self.device)
        visible[:rows, :width] = self.visible[:rows, :width]
        image[:rows, :width] = self.image_of_col[:rows, :width]
        self.visible, self.image_of_col = visible, image
        first = self.layers[0].keys
        if self.store is not None and first is not None:
            kept = [(layer.keys, layer.values) for layer in self.layers]
            shape = (slots, first.shape[1], capacity, first.shape[3])
            self._allocate(shape, self.layers[0].values.shape[3], first.dtype)
            for layer, (k, v) in zip(self.layers, kept, strict=True):
                layer.keys[:rows, :, :width] = k[:rows, :, :width]
                layer.values[:rows, :, :width] = v[:rows, :, :width]
        else:
            for layer in self.layers:
                if layer.keys is None:
                    continue
                for name in ("keys", "values"):
                    old = getattr(layer, name)
                    new = old.new_zeros((slots, old.shape[1], capacity, old.shape[3]))
                    new[:rows, :, :width] = old[:rows, :, :width]
                    setattr(layer, name, new)
                    del old  # one layer's old buffer at a time: the peak is one layer over
        self.slots, self.capacity = slots, capacity
        self._arange = torch.arange(slots, device=self.device)
        self.generation += 1

    def prefill(
        self,
        new_mask: torch.Tensor,
        image_ids: torch.Tensor,
        counts: list[int],
        first: int = 0,
        packed: bool = False,
    ) -> torch.Tensor | None:
        """Plan a forward of left-padded chunks ``[rows, T]`` for the rows in slots
        ``[first, first + rows)`` (``new_mask`` 1 on real tokens, ``counts`` real tokens per
        row); returns its attention mask ``[rows, 1, T, width]``, ``width`` their longest.
        ``packed``: the forward runs the real tokens alone, row after row in one sequence
        (``CacheBatch``'s packed prefill); it needs no mask, and None is returned."""
        b, t = new_mask.shape
        end = first + b
        before = self.fill[first:end]
        real = new_mask.bool()
        n = real.sum(1, keepdim=True)
        j = torch.arange(t, device=self.device)[None, :]
        fill = self.fill_dev[first:end, None]
        # Real tokens at the row's next columns; padding past them, never visible.
        cols = torch.where(real, fill + j - (t - n), fill + n + j)
        rows = self._arange[first:end, None].expand(b, t)
        self.visible[rows, cols] = real
        self.image_of_col[rows, cols] = image_ids
        self.fill_dev = self.fill_dev.index_add(0, self._arange[first:end], n[:, 0])
        self.fill[first:end] = [f + c for f, c in zip(self.fill[first:end], counts, strict=True)]
        width = max(self.fill[first:end])
        if packed:
            # Built on the host, where the counts are: a device-side selection would wait.
            at = np.concatenate([np.arange(f, f + c) for f, c in zip(before, counts, strict=True)])
            slot = np.repeat(np.arange(first, end), counts)
            index = torch.from_numpy(np.stack([slot, at])).to(self.device, non_blocking=True)
            self._write = (index[0][None], index[1][None], width, first, b)
            return None
        self._write = (rows, cols, width, first, b)
        causal = torch.arange(width, device=self.device)[None, None, :] <= cols[:, :, None]
        return (self.visible[first:end, None, :width] & causal)[:, None]

    def decode(self, active: torch.Tensor, active_host: list[bool]) -> torch.Tensor:
        """Plan a decode step (one token a row; inactive rows write nothing visible and keep
        their length); returns its attention mask ``[rows, 1, 1, width]``."""
        cols = self.advance(active, active_host)
        width = self.width
        self.plan_write(cols[:, None], width)
        return self.visible[: cols.shape[0], None, None, :width]

    def advance(self, active: torch.Tensor, active_host: list[bool]) -> torch.Tensor:
        """A decode step's bookkeeping: each row's next column becomes visible if the row is
        active, and the active rows grow by one; returns the columns written [rows]."""
        b = active.shape[0]
        rows, cols = self._arange[:b], self.fill_dev
        self.visible[rows, cols] = active
        self.image_of_col[rows, cols] = -1
        self.fill_dev = cols + active
        self.fill = [f + a for f, a in zip(self.fill, active_host, strict=True)]
        return cols

    @property
    def planned(self) -> tuple[torch.Tensor, int, int, int] | None:
        """The next forward's plan, if any: the columns each row writes, the width the
        attention reads, the first slot and the number of rows it covers."""
        return None if self._write is None else self._write[1:]

    def plan_write(self, cols: torch.Tensor, width: int, slots: torch.Tensor | None = None) -> None:
        """The next forward runs over slots ``[0, len(cols))``, slot ``i`` writing columns
        ``cols[i]`` (one for a decode step, a chunk's for a prefill) and attending over
        ``width`` columns (``clew.inference.cuda_graphs``, ``prefill_graphs``: fixed tensors
        a captured graph reads at every replay). ``slots``: the slot indices ``[rows, 1]``
        (``arange``) as a tensor of the caller's, for a graph that outlives this cache."""
        rows = self._arange[: cols.shape[0], None] if slots is None else slots
        self._write = (rows, cols, width, 0, cols.shape[0])

    def hide_images(self, limit: torch.Tensor) -> None:
        """Hide, per row, the columns of images numbered below ``limit`` [rows]."""
        w = self.width
        img = self.image_of_col[: self.rows, :w]
        hidden = (img >= 0) & (img < limit[:, None])
        self.visible[: self.rows, :w] &= ~hidden
        self.hidden_any = True

    def compact(self, threshold: float) -> None:
        """Move each row's visible columns to the front of its slot, once the longest row
        sees at most ``threshold`` of the width (see ``CacheBatch._compact``)."""
        b, w = self.rows, self.width
        if not self.hidden_any or w == 0:
            return
        vis = self.visible[:b, :w]
        counts = vis.sum(1)
        keep = int(counts.max())
        if keep > threshold * w:
            return
        order = torch.argsort((~vis).to(torch.int8), dim=1, stable=True)[:, :keep]
        for layer in self.layers:
            if layer.keys is None:
                continue
            for buf in (layer.keys, layer.values):
                index = order[:, None, :, None].expand(b, buf.shape[1], keep, buf.shape[3])
                buf[:b, :, :keep] = buf[:b, :, :w].gather(2, index)
        self.image_of_col[:b, :keep] = self.image_of_col[:b, :w].gather(1, order)
        self.visible[:b, :keep] = vis.gather(1, order)
        self.visible[:b, keep:w] = False
        self.fill_dev = counts
        self.fill = counts.tolist()
        self.hidden_any = False

    def keep(self, kept: list[int]) -> list[int]:
        """Keep the rows ``kept`` (ascending row indices); the last of them move into the
        freed slots below. Returns the old row index now in each slot."""
        n = len(kept)
        keep_set = set(kept)
        holes = [s for s in range(n) if s not in keep_set]
        movers = [r for r in kept if r >= n]
        order = list(range(n))
        for h, m in zip(holes, movers, strict=True):
            order[h] = m
        if movers:
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            w = max(self.fill[m] for m in movers)
            for buf in self.buffers():
                buf[dst, :, :w] = buf[src, :, :w]
            for table in (self.visible, self.image_of_col):
                table[dst] = table[src]
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        self.fill_dev = self.fill_dev.index_select(0, index)
        self.fill = [self.fill[o] for o in order]
        self.rows = n
        return order
