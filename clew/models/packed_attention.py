"""Attention over packed rows that stays within each sequence, with no dense mask.

A packed row holds several sequences end to end (``clew.train.model_batch.collate(pack=True)``).
Each must attend only to its own causal past, as if it were alone. Expressed as one
attention mask, that is a block-diagonal ``[W, W]`` mask per row: ``W**2`` entries to build
and hold (a micro-batch of 16 trajectories of 2,000 tokens packed into one row of 32,000
makes a mask of a billion entries, 2 GB in bfloat16), attention scores computed for every
pair of which only ``sum(n_i**2) / W**2`` are used (1/16 there), and on CUDA an arbitrary
mask keeps SDPA off its flash kernels.

Here each sequence is its own causal attention call instead, cut out of the row by index;
sequences of the same length go through one batched call (GRPO's samples often share a
length), so a micro-batch costs a handful of calls per layer. A sequence that hides old
images (``generator.keep_last_k_images``) brings its own ``[n, n]`` visibility mask, and
only where some image is really hidden; everything else runs SDPA's causal path. torch's
``varlen_attn`` is flash attention on CUDA only.

FlexAttention (``packed_attention(model, flex=True)``, ``trainer.flex_attention``) expresses
the same pattern, and the padded layout's, in one compiled call a layer: the batch brings a
block mask computed from its visibility vectors (``clew.models.visibility``), and
``flex_sdpa`` attends under it, skipping the blocks no query sees (above the diagonal, other
sequences of a packed row). It is CUDA's alone for training: on CPU FlexAttention has no
backward (torch 2.13), and inductor's CPU template fails to build some of its masks, so a
CPU forward runs it uncompiled (every score computed), as tests do. transformers'
``flex_attention`` implementation would compile it on the CPU too, hence this one.

The layout reaches attention as a keyword argument of the model's forward
(``packed_layout``), which transformers hands to every attention call; ``packed_attention``
switches the language model's attention to ``packed_sdpa`` for a block of forwards (and
their backward, where gradient checkpointing recomputes them). Without a layout it is
transformers' own SDPA, call for call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from clew.errors import ClewError
from clew.models.visibility import visibility_from_vectors

__all__ = [
    "FLEX",
    "IMPLEMENTATION",
    "PackedLayout",
    "QueryGroup",
    "flex_sdpa",
    "packed_attention",
    "packed_sdpa",
]

IMPLEMENTATION = "clew_packed_sdpa"
FLEX = "clew_flex_attention"


@dataclass
class QueryGroup:
    """Queries attended in one call: sequences of one length (and one kind of mask)."""

    index: Tensor  # Long[G, n]: each sequence's positions in the flattened rows
    mask: Tensor | None  # Bool[G, 1, n, n] when some of them hide images; None: causal


@dataclass
class PackedLayout:
    """Where each sequence of a packed batch lies, and what it may attend to.

    ``order`` puts the groups' outputs (concatenated, then the padding positions) back in
    row-major order. ``calls`` counts the attention calls that used this layout, so a
    forward can check that its attention really stayed within each sequence.
    """

    rows: int
    width: int
    groups: list[QueryGroup]
    order: Tensor  # Long[rows * width]
    padding: int  # positions outside every sequence (their output is 0)
    calls: int = field(default=0, compare=False)

    @classmethod
    def build(
        cls,
        document: Tensor,
        hidden_below: Tensor | None = None,
        image_of_key: Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> PackedLayout:
        """The layout of rows whose ``document [B, W]`` numbers each token's sequence in
        its row (-1 on padding); ``hidden_below`` / ``image_of_key [B, W]``: the image
        visibility vectors of ``clew.models.visibility`` (None: nothing is hidden)."""
        rows, width = document.shape
        spans: dict[tuple[int, bool], list[tuple[Tensor, Tensor | None]]] = {}
        covered = torch.zeros(rows * width, dtype=torch.bool)
        for b in range(rows):
            doc = document[b]
            for d in range(int(doc.max()) + 1):
                cols = (doc == d).nonzero().squeeze(-1)
                if cols.numel() == 0:
                    continue
                start, n = int(cols[0]), cols.numel()
                if int(cols[-1]) != start + n - 1:
                    raise ValueError(f"sequence {d} of packed row {b} is not contiguous")
                mask = None
                if hidden_below is not None and image_of_key is not None:
                    mask = _visibility(
                        hidden_below[b, start : start + n], image_of_key[b, start : start + n]
                    )
                flat = b * width + torch.arange(start, start + n)
                covered[flat] = True
                spans.setdefault((n, mask is not None), []).append((flat, mask))
        groups = []
        for (_, masked), members in sorted(spans.items()):
            index = torch.stack([flat for flat, _ in members]).to(device)
            mask = torch.stack([m for _, m in members])[:, None].to(device) if masked else None
            groups.append(QueryGroup(index, mask))
        pad = (~covered).nonzero().squeeze(-1)
        placed = torch.cat([*(g.index.flatten().cpu() for g in groups), pad])
        order = torch.empty_like(placed)
        order[placed] = torch.arange(placed.numel())
        return cls(rows, width, groups, order.to(device), pad.numel())


def _visibility(hidden_below: Tensor, image_of_key: Tensor) -> Tensor | None:
    """Bool ``[n, n]`` for one sequence, or None when it hides no image from any token
    (plain causal attention is then exact)."""
    images = image_of_key[image_of_key >= 0]
    if images.numel() == 0 or int(images.min()) >= int(hidden_below.max()):
        return None
    n = torch.tensor([hidden_below.numel()])
    return visibility_from_vectors(hidden_below[None], image_of_key[None], n)[0, 0]


def packed_sdpa(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_layout: PackedLayout | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: ``query [B, H, W, D]``, ``key`` and
    ``value [B, Hkv, W, D]``; returns ``[B, W, H, D]``. With ``packed_layout``, attention
    within each sequence (see the module docstring); without, transformers' SDPA."""
    if packed_layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layout = packed_layout
    b, h, w, d = query.shape
    hk = key.shape[1]
    if (b, w) != (layout.rows, layout.width):
        raise ClewError(
            f"a packed layout of {layout.rows} x {layout.width} tokens reached attention over "
            f"{b} x {w}"
        )
    layout.calls += 1
    flat = [t.transpose(1, 2).reshape(b * w, t.shape[1], d) for t in (query, key, value)]
    outputs = []
    for group in layout.groups:
        q, k, v = (t[group.index].transpose(1, 2) for t in flat)  # [G, heads, n, D]
        if group.mask is not None and hk != h:
            # A mask keeps CUDA's SDPA off the kernels that read grouped KV heads as they are.
            k, v = k.repeat_interleave(h // hk, dim=1), v.repeat_interleave(h // hk, dim=1)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=group.mask,
            dropout_p=dropout if module.training else 0.0,
            is_causal=group.mask is None,
            scale=scaling,
            enable_gqa=k.shape[1] != h,
        )
        outputs.append(out.transpose(1, 2).reshape(-1, h, d))
    if layout.padding:
        outputs.append(query.new_zeros(layout.padding, h, d))
    return torch.cat(outputs)[layout.order].view(b, w, h, d), None


_compiled_flex: Any = None


def flex_sdpa(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature, under ``attention_mask``, FlexAttention's
    block mask (``clew.models.visibility.visibility_block_mask``); returns ``[B, W, H, D]``.
    Compiled on CUDA (once; later shapes reuse or extend the compiled kernel), uncompiled on
    the CPU (module docstring)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if not isinstance(attention_mask, BlockMask):
        raise ClewError(
            f"FlexAttention got a {type(attention_mask).__name__} mask; its forwards take the "
            f"batch's block mask (ModelBatch.model_inputs(flex=True))"
        )
    if dropout and module.training:
        raise ClewError("FlexAttention here has no attention dropout; set it to 0")
    attend = flex_attention
    if query.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)
        attend = _compiled_flex
    out = attend(
        query,
        key,
        value,
        block_mask=attention_mask,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2), None


AttentionInterface.register(IMPLEMENTATION, packed_sdpa)
AttentionInterface.register(FLEX, flex_sdpa)
# Batches without a layout keep SDPA's own masks (padding), built the same way. A flex
# forward's mask is always the batch's 4D block mask, which transformers passes on as it is.
for _name in (IMPLEMENTATION, FLEX):
    AttentionMaskInterface.register(_name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _language_configs(model: torch.nn.Module) -> list[Any]:
    """The config objects the language model's attention reads its implementation from
    (the vision tower's are left alone: its attention never sees a packed row)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    configs = {id(c): c for m in decoder.modules() if (c := getattr(m, "config", None)) is not None}
    return list(configs.values())


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module, flex: bool = False) -> Iterator[None]:
    """Run ``model``'s language attention through ``packed_sdpa`` for the block; forwards
    of packed rows (and the backward of any that gradient checkpointing recomputes) must
    run inside it. ``flex``: through ``flex_sdpa`` instead, for forwards whose mask is a
    block mask (``ModelBatch.model_inputs(flex=True)``). Restores what was set before on
    the way out."""
    configs = _language_configs(model)
    before = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = FLEX if flex else IMPLEMENTATION
    try:
        yield
    finally:
        for c, impl in zip(configs, before, strict=True):
            c._attn_implementation = impl
