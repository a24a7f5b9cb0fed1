"""A turn's prefill attention reading each row's own columns of the ``SlotCache``
(``prefill_attention=varlen``; ``clew.inference.attention`` has the plan): FlashAttention's
variable-length kernel on a GPU that runs it, masked SDPA over the same flat tensors
elsewhere (what the tests compare), for left-padded chunks and for packed ones."""

from __future__ import annotations

import torch

from clew.kernels.slot_views import flash_runs, row_keys, slot_layout, varlen_index


def varlen_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    starts: torch.Tensor | None = None,
    max_new: int = 0,
) -> torch.Tensor:
    """A chunk of ``T`` queries a row, ``query`` [B, H, T, D] left-padded, over views
    ``key``/``value`` [B, Hkv, W, D] of consecutive slots of ``SlotCache`` buffers: row ``r``
    reads its first ``lengths[r]`` columns, the last of which are its chunk's real tokens,
    causally (query ``j`` sees columns up to ``lengths[r] - T + j``). Returns [B, T, H, D];
    a padding query's output is what the kernel makes of fewer columns (zero for none), and
    nothing reads it. FlashAttention's variable-length kernel on a GPU that runs it
    (``seqused_k``, causal from the bottom right, grouped-query heads in the kernel), the
    same flat tensors through masked SDPA elsewhere. With ``starts`` (int32 [B + 1]) the
    chunks are packed: ``query`` [1, H, N, D] holds row ``r``'s queries from position
    ``starts[r]`` to ``starts[r + 1]``, at most ``max_new`` a row; returns [1, N, H, D]."""
    b = lengths.shape[0]
    _, heads, t, d = query.shape  # t: the padded width, or a packed forward's tokens
    kv_heads, _, cap = slot_layout(query, key, value, "prefill")
    # One sequence a row. [B, H, T, D] is a transpose of the projection's [B, T, H, D], so
    # the queries' flat form is a view, and so is the output's [B, T, H, D].
    q = query.transpose(1, 2).reshape(-1, heads, d)
    rows_k, rows_v = row_keys(key, b, cap), row_keys(value, b, cap)
    per_row = t if starts is None else max_new
    seqlens, cu_q, cu_k = varlen_index(lengths, 1, kv_heads * cap, per_row)
    cu_q = cu_q if starts is None else starts
    if query.device.type == "cuda" and query.dtype == key.dtype and flash_runs(query):
        out = torch.ops.aten._flash_attention_forward(
            q, rows_k, rows_v, cu_q, cu_k, per_row, cap, 0.0, True, False, scale=scale,
            seqused_k=seqlens,
        )[0]  # fmt: skip
    elif starts is None:
        out = _varlen_reference(q, rows_k, rows_v, seqlens, cu_k, t, cap, scale)
    else:
        out = _packed_reference(q, rows_k, rows_v, seqlens, cu_k, starts, scale)
    return out.reshape(query.shape[0], t, heads, d)


def _packed_reference(
    q: torch.Tensor,
    rows_k: torch.Tensor,
    rows_v: torch.Tensor,
    seqlens: torch.Tensor,
    cu_k: torch.Tensor,
    starts: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """``_varlen_reference`` of packed queries ``q`` [N, H, D], row ``r``'s from
    ``starts[r]`` to ``starts[r + 1]``: row by row through masked SDPA."""
    out = torch.zeros_like(q)
    bounds = starts.tolist()  # the reference path: a host read is no matter here
    for r, length in enumerate(seqlens.tolist()):
        lo, hi = bounds[r], bounds[r + 1]
        if hi == lo:
            continue
        keys = rows_k[int(cu_k[r]) : int(cu_k[r]) + length].transpose(0, 1)  # [Hkv, L, D]
        values = rows_v[int(cu_k[r]) : int(cu_k[r]) + length].transpose(0, 1)
        last = length - (hi - lo) + torch.arange(hi - lo, device=q.device)  # [n]
        allowed = torch.arange(length, device=q.device)[None, :] <= last[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1)[None], keys[None].to(q.dtype), values[None].to(q.dtype),
            allowed[None, None], scale=scale, enable_gqa=True,
        )[0]  # fmt: skip
        out[lo:hi] = torch.where(allowed.any(-1)[None, :, None], o, 0.0).transpose(0, 1)
    return out


def _varlen_reference(
    q: torch.Tensor,
    rows_k: torch.Tensor,
    rows_v: torch.Tensor,
    seqlens: torch.Tensor,
    cu_k: torch.Tensor,
    t: int,
    cap: int,
    scale: float | None,
) -> torch.Tensor:
    """What ``_flash_attention_forward`` computes from the same flat tensors: ``q``
    [B * t, H, D], ``rows_k``/``rows_v`` [total, Hkv, D] with row ``r``'s keys from
    ``cu_k[r]`` on, row ``r`` reading its first ``seqlens[r]`` keys causally from the bottom
    right; a query with no key gets 0."""
    b, heads, d = seqlens.shape[0], q.shape[1], q.shape[2]
    cols = cu_k[:-1, None].long() + torch.arange(cap, device=q.device)[None, :]  # [B, cap]
    keys, values = (x[cols].transpose(1, 2) for x in (rows_k, rows_v))  # [B, Hkv, cap, D]
    last = seqlens[:, None] - t + torch.arange(t, device=q.device)[None, :]  # [B, t]
    allowed = torch.arange(cap, device=q.device)[None, None, :] <= last[:, :, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(b, t, heads, d).transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
        allowed[:, None], scale=scale, enable_gqa=True,
    )  # fmt: skip
    out = torch.where(allowed.any(-1)[:, None, :, None], out, 0.0)
    return out.transpose(1, 2).reshape(b * t, heads, d)
