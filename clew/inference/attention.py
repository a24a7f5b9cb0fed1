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
the longest row's width, though. A decode step replayed from a CUDA graph may instead pass
a FlexAttention ``BlockMask`` (``generator.inference_engine.decode_attention=flex``,
``clew.inference.cuda_graphs``): each row then reads only the 128-column blocks up to its own
length, through ``torch.compile``'d ``flex_attention`` on CUDA (its unfused reference on a
CPU, which the tests compare).

The function is registered in transformers' ``AttentionInterface`` under ``ATTENTION`` and
selected only inside ``engine_attention``, on the text model's config alone: the vision
tower and the trainer's forwards keep their own attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface

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
    if isinstance(attention_mask, BlockMask):
        out = _flex(query, key, value, attention_mask, scaling)
        return out.transpose(1, 2).contiguous(), None
    b, heads, t, d = query.shape
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


_compiled_flex = None


def _flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: BlockMask,
    scale: float | None,
) -> torch.Tensor:
    """Grouped-query FlexAttention under ``block_mask``: compiled on CUDA (compiled once
    with dynamic shapes for every batch and cache size), the unfused reference elsewhere."""
    global _compiled_flex
    fn = flex_attention
    if query.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    return fn(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True)


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
