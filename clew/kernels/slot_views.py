"""How clew's variable-length attention kernels read the ``SlotCache``'s buffers, and which
lengths the forward under way gives them (``clew.inference.attention`` has the plan).

A slot buffer ``[slots, kv_heads, capacity, head_dim]`` is already a flat run of sequences,
one per (slot, KV head) of ``capacity`` columns, or one per slot with the heads ``capacity x
head_dim`` apart: ``varlen_index`` gives a kernel each sequence's length and offsets,
``flat_keys`` and ``row_keys`` the two views, nothing copied. ``row_lengths`` (a decode
step) and ``prefill_lengths`` (a turn's prefill) set the rows' lengths for the forward's
layers, which build the index once and share it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

KERNELS = ("efficient", "triton")  # varlen_decode's kernels (clew.inference.attention)

DECODE = threading.local()  # .lengths, .kernel, .index: those of the decode step being run
PREFILL = threading.local()  # .lengths, .kernel, .index, .starts, .max_new: the prefill's


@contextlib.contextmanager
def row_lengths(lengths: torch.Tensor, kernel: str = "efficient") -> Iterator[None]:
    """Within the block, one-query forwards attend to each row's first ``lengths[row]``
    columns of the cache (``varlen_decode`` with ``kernel``) and ignore the mask."""
    if kernel not in KERNELS:
        raise ValueError(f"no varlen decode kernel {kernel!r}; choose one of {KERNELS}")
    DECODE.lengths, DECODE.kernel, DECODE.index = lengths, kernel, {}
    try:
        yield
    finally:
        DECODE.lengths, DECODE.kernel, DECODE.index = None, "efficient", {}


@contextlib.contextmanager
def prefill_lengths(
    lengths: torch.Tensor,
    kernel: str = "varlen",
    starts: torch.Tensor | None = None,
    max_new: int = 0,
) -> Iterator[None]:
    """Within the block, the forward's chunks (left-padded, each row's real tokens last)
    attend causally to each row's first ``lengths[row]`` columns of the cache and the mask
    is ignored: through ``varlen_prefill`` (``kernel="varlen"``) or ``prefill_triton``
    (``"triton"``). With ``starts`` (int32 [rows + 1]) the chunks are packed instead, one
    row after another on the position axis of a batch of one, at most ``max_new`` a row."""
    PREFILL.lengths, PREFILL.index, PREFILL.kernel = lengths, {}, kernel
    PREFILL.starts, PREFILL.max_new = starts, max_new
    try:
        yield
    finally:
        PREFILL.lengths, PREFILL.index, PREFILL.kernel = None, {}, "varlen"
        PREFILL.starts, PREFILL.max_new = None, 0


def varlen_index(
    lengths: torch.Tensor, kv_heads: int, cap: int, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's per-sequence key lengths and query and key offsets (``group`` queries a
    sequence); within ``row_lengths`` or ``prefill_lengths`` built by the first layer and
    reused by the others (once per forward)."""
    memo = None
    for context in (DECODE, PREFILL):
        if lengths is getattr(context, "lengths", None):
            memo = context.index
    if memo is not None and (kv_heads, cap, group) in memo:
        return memo[(kv_heads, cap, group)]
    n, dev = lengths.shape[0] * kv_heads, lengths.device
    index = (
        lengths[:, None].expand(-1, kv_heads).reshape(n).to(torch.int32),
        torch.arange(0, (n + 1) * group, group, device=dev, dtype=torch.int32),
        torch.arange(0, (n + 1) * cap, cap, device=dev, dtype=torch.int32),
    )
    if memo is not None:
        memo[(kv_heads, cap, group)] = index
    return index


def slot_layout(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, what: str
) -> tuple[int, int, int]:
    """KV heads, query heads a KV head and slot capacity of views ``key``/``value``
    [B, Hkv, W, D] of ``SlotCache`` buffers; another layout is refused."""
    d, kv_heads = query.shape[-1], key.shape[1]
    cap = key.stride(1) // d
    for x in (key, value):
        if x.stride() != (kv_heads * cap * d, cap * d, d, 1):
            raise ValueError(f"varlen {what} reads the SlotCache's buffers, got another layout")
    return kv_heads, query.shape[1] // kv_heads, cap


def flat_keys(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` consecutive key (or value) vectors of the slot buffer ``x`` views from its
    first one, as ``[rows, 1, D]``: every (slot, KV head) a run of ``capacity`` rows."""
    d = x.shape[-1]
    return torch.as_strided(x, (rows, 1, d), (d, d, 1), x.storage_offset())


def row_keys(x: torch.Tensor, rows: int, cap: int) -> torch.Tensor:
    """Slot buffer view ``x`` [B, Hkv, W, D] (slots of ``cap`` columns, ``slot_layout``) as
    FlashAttention's flat keys ``[total, Hkv, D]`` of one sequence a row: row ``r``'s column
    ``j`` of head ``h`` is at ``r * Hkv * cap + j`` (row stride ``D``, head stride
    ``cap x D``), nothing copied. ``total`` stops where the last row's last head ends."""
    kv_heads, d = x.shape[1], x.shape[-1]
    total = (rows - 1) * kv_heads * cap + cap
    return torch.as_strided(x, (total, kv_heads, d), (d, cap * d, 1), x.storage_offset())


def flash_runs(query: torch.Tensor) -> bool:
    """FlashAttention's kernel: half precision, head sizes to 256 in steps of 8, Ampere on."""
    d = query.shape[-1]
    return (
        query.dtype in (torch.float16, torch.bfloat16)
        and d % 8 == 0
        and d <= 256
        and torch.cuda.get_device_capability(query.device)[0] >= 8
    )
