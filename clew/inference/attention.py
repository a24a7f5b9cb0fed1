"""The engine's attention: grouped-query SDPA over the KV heads as they are, never expanded.

transformers' ``sdpa`` path expands the KV heads to the query heads (``repeat_kv``) over
the whole cache whenever an attention mask is passed, and the engine always passes one
(rows have different lengths). At 8 KV heads for 32 query heads that is four copies of the
cache per layer and step, which made the decode step a memory copy. This function reads the
KV heads as they are:

- one query per row (a decode step): the query heads of each KV head are folded into the
  query-length axis, ``[B, H, 1, D] -> [B, Hkv, H/Hkv, D]``, so plain SDPA over
  ``[B, Hkv, L, D]`` keys computes grouped-query attention with no GQA support needed from
  the kernel, and the mask ``[B, 1, 1, L]`` broadcasts over the folded axis as it is;
- several queries per row (a turn's prefill):
  ``scaled_dot_product_attention(..., enable_gqa=True)``. The mask there is
  ``[B, 1, T, L]``; folding would need it repeated per query head. On CUDA, torch's
  memory-efficient kernel takes grouped KV heads with a mask (an older torch falls back to
  the math kernel, which expands them, as transformers did).

Why SDPA by default: the engine's mask is a boolean tensor built once per forward from the
rows' lengths and hidden columns (``clew.inference.kv_cache``) and shared by every layer,
which SDPA takes as it is, on every device and in eager mode. SDPA reads every row's keys to
the longest row's width, though.

With ``generator.inference_engine.decode_attention=varlen`` a decode step replayed from a
CUDA graph gives each row's length instead (``row_lengths``): every (row, KV head) of the
cache's buffers is then one sequence of the slot's capacity whose first ``length`` columns
are read, through torch's variable-length memory-efficient kernel (``seqlen_k``), so each
row reads its own keys and no more, with no mask. The buffers' ``[slots, kv_heads,
capacity, head_dim]`` layout is already that flat sequence of sequences, so nothing is
copied. This holds while no image column is hidden (the rows' visible columns are then
exactly their first ``length``); ``clew.inference.cuda_graphs`` steps with the mask
otherwise. On a CPU the same lengths build a mask over the capacity for SDPA (what the tests
compare). FlashAttention's variable-length form (``seqused_k``) reads the same flattening;
inside a CUDA-graph step at Qwen3-VL-8B's shape it was measured no faster (slower at the
larger batch), and its bf16 rounding of the attention weights flipped greedy tokens of the
tiny test policy, so ``varlen`` keeps the memory-efficient kernel
(``benchmarks/decode_attention.py`` times both). ``decode_attention=triton`` reads the same
columns through clew's split-KV kernel (``clew.kernels.split_decode``), which loads each KV
head once for its group of query heads.

A turn's prefill may read each row's own columns too (``prefill_attention=varlen``,
``prefill_lengths``): every row is one sequence of the chunk's ``T`` queries over the row's
slot, read to the row's length, causal from the bottom right (the chunk is left-padded, so a
row's real tokens are its last queries and its last columns). FlashAttention's
variable-length kernel takes that shape with ``seqused_k`` and does the grouped-query heads
itself, so no row reads past its length, none is masked and nothing is copied: the queries
``[B * T, H, D]`` are the projection's output as it is, the keys a strided view of the
slots (``clew.kernels.slot_views.row_keys``), and the output is already ``[B, T, H, D]``.
Elsewhere the same flat tensors go through masked SDPA (``clew.kernels.prefill_varlen``,
what the tests compare). As for decode steps, the rows' visible columns must be their first
``length``: the engine takes the masked prefill while an image is hidden. Packed chunks
(``prefill_lengths(starts=)``, on a GPU: the rows' real tokens one after another in a batch
of one) take the same kernels with one sequence a row of its own length,
FlashAttention's ``cu_seqlens_q`` being the rows' starts. ``prefill_attention=triton`` reads
the same columns through clew's kernel (``clew.kernels.prefill_triton``), which packs each
KV head's query heads into one block of queries where FlashAttention's blocks hold one head.

The function is registered in transformers' ``AttentionInterface`` under ``ATTENTION`` and
selected only inside ``engine_attention``, on the text model's config alone: the vision
tower and the trainer's forwards keep their own attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface

from clew.kernels.prefill_triton import prefill_triton
from clew.kernels.prefill_varlen import varlen_prefill
from clew.kernels.slot_views import (
    DECODE,
    PREFILL,
    flat_keys,
    slot_layout,
    varlen_index,
)
from clew.kernels.split_decode import split_decode

ATTENTION = "clew_gqa_sdpa"


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` [B, H, T, D] over ``key``/``value`` [B, Hkv, L, D] under a
    boolean ``attention_mask`` [B, 1, T, L] (True: attend); returns [B, T, H, D]."""
    b, heads, t, d = query.shape
    ends = getattr(PREFILL, "lengths", None)
    if ends is not None:
        starts = getattr(PREFILL, "starts", None)
        packed = {} if starts is None else {"starts": starts, "max_new": PREFILL.max_new}
        if getattr(PREFILL, "kernel", "varlen") == "triton":  # Triton's interpreter on a CPU
            interpret = not query.is_cuda
            return prefill_triton(
                query, key, value, ends, scaling, interpret=interpret, **packed
            ), None
        return varlen_prefill(query, key, value, ends, scaling, **packed), None
    lengths = getattr(DECODE, "lengths", None)
    if lengths is not None and t == 1:
        kernel = getattr(DECODE, "kernel", "efficient")
        return varlen_decode(query, key, value, lengths, scaling, kernel), None
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    group = heads // kv_heads
    if t == 1 and group > 1:
        # Query heads h = k * group + g share KV head k: fold g into the query axis.
        folded = query.reshape(b, kv_heads, group, d)
        out = torch.nn.functional.scaled_dot_product_attention(
            folded, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
        )
        return out.reshape(b, 1, heads, d), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=group > 1,
    )
    return out.transpose(1, 2).contiguous(), None


def varlen_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    kernel: str = "efficient",
) -> torch.Tensor:
    """One query a row, ``query`` [B, H, 1, D], over views ``key``/``value`` [B, Hkv, W, D]
    of consecutive slots of ``SlotCache`` buffers, each row reading its first ``lengths``
    [B] columns of its slot, through ``kernel`` ("efficient" or "triton", module docstring);
    returns [B, 1, H, D]."""
    b, heads, _, d = query.shape
    if kernel == "triton":  # clew's split-KV kernel; Triton's interpreter on a CPU
        return split_decode(query, key, value, lengths, scale, interpret=not query.is_cuda)
    kv_heads, group, cap = slot_layout(query, key, value, "decode")
    n = b * kv_heads  # sequences: every (row, KV head), `group` queries and `cap` columns each
    if query.device.type != "cuda":  # the reference: a mask over each slot's capacity
        keys, values = (
            torch.as_strided(x, (b, kv_heads, cap, d), x.stride(), x.storage_offset())
            for x in (key, value)
        )
        live = torch.arange(cap, device=key.device)[None, :] < lengths[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(b, kv_heads, group, d), keys, values, live[:, None, None], scale=scale
        )
        return out.reshape(b, 1, heads, d)
    seqlens, cu_q, cu_k = varlen_index(lengths, kv_heads, cap, group)
    out = torch.ops.aten._efficient_attention_forward(
        query.reshape(1, n * group, 1, d), flat_keys(key, n * cap)[None],
        flat_keys(value, n * cap)[None], None, cu_q, cu_k, group, cap, 0.0, 0, False, scale=scale,
        seqlen_k=seqlens,
    )[0]  # fmt: skip
    return out.reshape(b, 1, heads, d)


AttentionInterface.register(ATTENTION, gqa_sdpa_attention)


def text_config(model: torch.nn.Module) -> object:
    """The config the language model's attention layers read their implementation from."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base.config, "text_config", None) or base.config


@contextlib.contextmanager
def engine_attention(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the text model of ``model`` attends with ``gqa_sdpa_attention``."""
    config = text_config(model)
    saved = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = saved
