"""The engine's reference KV cache (``generator.inference_engine.kv_cache=dynamic``).

``DynamicKV`` is the engine as it was before ``SlotCache`` (``clew.inference.kv_cache``): a
transformers ``DynamicCache`` that concatenates every forward's keys onto the whole cache,
rows left-padded to one width, a 0/1 padding mask, and ``index_select``/``gather`` for
finished rows and hidden columns. Kept as the baseline the benchmarks and tests compare the
in-place cache against.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class DynamicKV:
    """The reference cache: transformers' ``DynamicCache`` with left-padded rows."""

    def __init__(
        self, rows: int, device: torch.device, *, bytes_per_token: int, budget_bytes: int | None
    ) -> None:
        self.cache = DynamicCache()
        self.device = device
        self.bytes_per_token = bytes_per_token
        self.budget_bytes = budget_bytes
        # Which image (per sequence, counted from 0) each cache column holds; -1 for text.
        self.image_of_col = torch.zeros(rows, 0, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, 0, dtype=torch.long, device=device)

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def fits(self, extra: int) -> bool:
        rows = self.mask.shape[0]
        budget = self.budget_bytes
        return budget is None or (self.width + extra) * rows * self.bytes_per_token <= budget

    def reserve(self, need: int) -> None:
        """Nothing to reserve: every forward concatenates."""

    def prefill(
        self, new_mask: torch.Tensor, image_ids: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        self.mask = torch.cat([self.mask, new_mask.to(self.device)], dim=1)
        self.image_of_col = torch.cat([self.image_of_col, image_ids.to(self.device)], dim=1)
        return self.mask

    def decode(self, active: torch.Tensor, active_host: list[bool]) -> torch.Tensor:
        step = active.long()[:, None]
        self.mask = torch.cat([self.mask, step], dim=1)
        self.image_of_col = torch.cat([self.image_of_col, torch.full_like(step, -1)], dim=1)
        return self.mask

    def keep(self, kept: list[int]) -> list[int]:
        idx = torch.tensor(kept, dtype=torch.long, device=self.device)
        self.mask = self.mask.index_select(0, idx)
        self.image_of_col = self.image_of_col.index_select(0, idx)
        self._select(batch=idx)
        if kept:
            cols = self.mask.any(0).nonzero().squeeze(-1)
            if len(cols) < self.mask.shape[1]:
                self.mask = self.mask.index_select(1, cols)
                self.image_of_col = self.image_of_col.index_select(1, cols)
                self._select(cols=cols)
        return list(kept)

    def _select(self, batch: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> None:
        for layer in getattr(self.cache, "layers", []):
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            if batch is not None:
                layer.keys = layer.keys.index_select(0, batch)
                layer.values = layer.values.index_select(0, batch)
            if cols is not None:
                layer.keys = layer.keys.index_select(2, cols)
                layer.values = layer.values.index_select(2, cols)

    def hide_images(self, limit: torch.Tensor) -> None:
        if self.image_of_col.numel() == 0:
            return
        hidden = (self.image_of_col >= 0) & (self.image_of_col < limit[:, None])
        self.mask = self.mask.masked_fill(hidden, 0)

    def compact(self, threshold: float) -> None:
        """Drop the columns a row can no longer see (hidden images, padding), row by row.

        A hidden column is never shown again and a masked column adds exactly nothing to
        attention, so removing it changes no logit (up to float summation order); the cached
        keys already carry their rotary positions, so moving a column changes nothing either.
        """
        b, n = self.mask.shape
        if n == 0:
            return
        visible = self.mask.bool()
        width = int(visible.sum(1).max())
        # A copy of the whole cache per compaction: only worth it once a quarter is dead.
        if width > threshold * n:
            return
        # Visible columns keep their order and are right-aligned; a row with fewer than
        # ``width`` is left-padded with some of its masked columns.
        order = torch.argsort(visible.to(torch.int8), dim=1, stable=True)
        idx = order[:, n - width :]
        self.mask = self.mask.gather(1, idx)
        self.image_of_col = self.image_of_col.gather(1, idx)
        for layer in getattr(self.cache, "layers", []):
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            for name in ("keys", "values"):
                t = getattr(layer, name)
                index = idx[:, None, :, None].expand(b, t.shape[1], width, t.shape[3])
                setattr(layer, name, t.gather(2, index))
