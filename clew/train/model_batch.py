"""Padded model inputs from whole episodes, for the training forward pass.

The trainer sees an episode as the rollout engine left it: one token sequence (user turns,
images, replies), a loss mask that is 1 on generated tokens, and the episode's images. The
engine built it chunk by chunk with a KV cache and left padding; training runs each episode
as one causal forward with right padding. For the two to give the same logprobs, the
inputs must be the same tokens at the same M-RoPE positions with the same pixels, so this
module recomputes positions with ``sequence_positions`` (the engine's own function) and
re-encodes the images with the same ``ChatFormat``.

Everything per token that a loss needs is *target-aligned*: index ``t`` of a row describes
token ``t + 1``, the one predicted from position ``t``. ``target_values`` converts the
engine's token-aligned values (``Trajectory.logprobs``, index ``t`` describes token ``t``)
by dropping the first entry, which is never a generated token.

Nothing here knows the model; ``ModelBatch.model_inputs`` gives the keyword arguments a
Qwen-VL forward takes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from clew.models.chat import ChatFormat
from clew.models.packed_attention import PackedLayout
from clew.models.pixels import Frames, Pixels, as_patches, cat_pixels
from clew.models.positions import sequence_positions
from clew.models.visibility import (
    hiding_vectors,
    visibility_block_mask,
    visibility_from_vectors,
)
from clew.train.micro_batches import pack_rows

Vision = tuple[Pixels | None, Tensor | None]
"""``(pixel_values, image_grid_thw)`` of one sequence's images, or ``(None, None)``.

Pixel values stay ``Frames`` (bytes) where they can, and are patched on the model's device.
"""


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """``t`` on ``device``. A copy from the host does not wait for the device: a blocking
    copy waits for all the work queued before it, so the host could not prepare the next
    micro-batch's forward while the device runs the last backward. From pageable memory the
    copy is staged before this returns, so the source may change right after."""
    return t.to(device, non_blocking=t.device.type == "cpu")


class SequenceLike(Protocol):
    """What a training sequence must carry (``Trajectory`` and ``Sample`` both do)."""

    token_ids: list[int]
    loss_mask: list[int]
    images: list[Image.Image]


@dataclass
class Sample:
    """A training sequence that did not come from a rollout (e.g. an SFT demonstration)."""

    token_ids: list[int]
    loss_mask: list[int]
    images: list[Image.Image] = field(default_factory=list)


@dataclass
class ModelBatch:
    """Right-padded inputs of ``B`` sequences (longest ``L``) and their targets.

    ``targets[b, t] = input_ids[b, t + 1]`` and ``target_mask`` is the loss mask of those
    tokens (0 on padding); ``values`` holds per-target tensors such as old logprobs and
    advantages, padded with 0.
    """

    input_ids: Tensor  # Long[B, L]
    attention_mask: Tensor  # Long[B, L]
    position_ids: Tensor  # Long[3, B, L]
    pixel_values: Pixels | None
    image_grid_thw: Tensor | None
    targets: Tensor  # Long[B, L - 1]
    target_mask: Tensor  # Float[B, L - 1]
    lengths: list[int]
    values: dict[str, Tensor] = field(default_factory=dict)  # Float[B, L - 1] each
    # Long[B, L] each when some sequence hid old images (generator.keep_last_k_images): per
    # query, the image index below which images are hidden; per key, its image (-1: text).
    hidden_below: Tensor | None = None
    image_of_key: Tensor | None = None
    # Long[B, L] when rows are packed (``collate(pack=True)``): which of the row's sequences
    # each token belongs to (-1 on padding); ``lengths`` are then the rows' filled lengths.
    document: Tensor | None = None
    # Packed: the index (in the list given to ``collate``) of each row's sequences, in the
    # order they are laid out, and every sequence's length in that list's order.
    members: list[list[int]] | None = None
    sequence_lengths: list[int] | None = None

    @property
    def visibility(self) -> Tensor | None:
        """Bool ``[B, 1, L, L]`` attention mask (on the host), or None without hidden images."""
        if self.hidden_below is None or self.image_of_key is None:
            return None
        lengths = torch.tensor(self.lengths)
        return visibility_from_vectors(self.hidden_below, self.image_of_key, lengths, self.document)

    @property
    def num_sequences(self) -> int:
        if self.document is not None:  # packed: several a row
            return int((self.document.max(dim=1).values + 1).sum())
        return len(self.lengths)

    @property
    def num_target_tokens(self) -> int:
        return int(self.target_mask.sum().item())

    def model_inputs(
        self, device: torch.device | str, dtype: torch.dtype = torch.float32, flex: bool = False
    ) -> dict[str, Any]:
        """Keyword arguments of the model's forward, on ``device``.

        With ``visibility``, the attention mask is a 4D additive mask in ``dtype`` (0 where
        attention is allowed), which transformers passes to attention as it is. Packed rows
        pass no mask but a ``packed_layout`` (``clew.models.packed_attention``): the
        forward must then run inside ``packed_attention(model)``. ``flex``: every layout's
        mask is FlexAttention's block mask instead (``visibility_block_mask``), for a forward
        inside ``packed_attention(model, flex=True)``.
        """
        inputs: dict[str, Any] = {
            "input_ids": to_device(self.input_ids, device),
            "position_ids": to_device(self.position_ids, device),
        }
        if flex:
            vectors = (self.hidden_below, self.image_of_key, self.document)
            inputs["attention_mask"] = visibility_block_mask(
                to_device(torch.tensor(self.lengths), device),
                self.input_ids.shape[1],
                *(None if v is None else to_device(v, device) for v in vectors),
            )
        elif self.document is not None:
            inputs["attention_mask"] = None
            inputs["packed_layout"] = PackedLayout.build(
                self.document, self.hidden_below, self.image_of_key, device
            )
        elif self.hidden_below is not None and self.image_of_key is not None:
            allowed = visibility_from_vectors(
                to_device(self.hidden_below, device),
                to_device(self.image_of_key, device),
                to_device(torch.tensor(self.lengths), device),
            )
            mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=device)
            inputs["attention_mask"] = mask.masked_fill_(allowed, 0.0)
        else:
            inputs["attention_mask"] = to_device(self.attention_mask, device)
        if self.pixel_values is not None:
            inputs["pixel_values"] = as_patches(self.pixel_values, device)
            inputs["image_grid_thw"] = to_device(self.image_grid_thw, device)
        return inputs

    def unpad(self, per_target: Tensor) -> list[Tensor]:
        """Rows of a ``[B, L - 1]`` tensor cut to each sequence's ``length - 1`` targets."""
        if self.document is not None:
            raise ValueError(
                "a packed batch's rows hold several sequences; unpad needs one per row"
            )
        return [per_target[b, : n - 1] for b, n in enumerate(self.lengths)]

    def per_sequence(self, per_target: Tensor) -> list[Tensor]:
        """Each sequence's ``length - 1`` targets of a ``[B, L - 1]`` tensor, in the order
        of the list given to ``collate`` (packed or not)."""
        if self.document is None:
            return self.unpad(per_target)
        assert self.members is not None
        order = [i for members in self.members for i in members]
        out: list[Tensor] = [per_target.new_zeros(0)] * len(order)
        for i, (row, off, n) in zip(order, self._placements(), strict=True):
            out[i] = per_target[row, off : off + n - 1]
        return out

    def _placements(self) -> list[tuple[int, int, int]]:
        """``(row, offset, length)`` of each packed sequence, in packing order."""
        assert self.members is not None and self.sequence_lengths is not None
        out = []
        for row, members in enumerate(self.members):
            off = 0
            for i in members:
                out.append((row, off, self.sequence_lengths[i]))
                off += self.sequence_lengths[i]
        return out

    def unpack(self, per_token: Tensor, target_aligned: bool = True) -> Tensor:
        """A packed ``[B, L - 1]`` (``target_aligned``) or ``[B, L]`` tensor laid out one
        sequence a row, in packing order, right-padded with 0: ``[S, M - 1]`` or ``[S, M]``
        (``M`` the longest sequence). Differentiable: the objective reads the policy's
        logprobs through it."""
        shift = 1 if target_aligned else 0
        cols = per_token.shape[-1]
        places = self._placements()
        longest = max(n for _, _, n in places) - shift
        index = torch.zeros(len(places), longest, dtype=torch.long)
        valid = torch.zeros(len(places), longest, dtype=torch.bool)
        for s, (row, off, n) in enumerate(places):
            index[s, : n - shift] = row * cols + off + torch.arange(n - shift)
            valid[s, : n - shift] = True
        index, valid = index.to(per_token.device), valid.to(per_token.device)
        picked = per_token.reshape(-1)[index]
        return picked.masked_fill(~valid, 0)

    def unpacked(self) -> ModelBatch:
        """The same sequences one a row, in packing order (so row-major order of the loss-mask
        targets is the packed batch's): what a loss that reduces per sequence needs. Only
        the per-token fields a loss reads are laid out anew; images stay as they are."""
        if self.document is None:
            return self
        assert self.members is not None and self.sequence_lengths is not None
        order = [i for members in self.members for i in members]
        return ModelBatch(
            input_ids=self.unpack(self.input_ids, target_aligned=False),
            attention_mask=self.unpack(self.attention_mask, target_aligned=False),
            position_ids=torch.stack(
                [self.unpack(p, target_aligned=False) for p in self.position_ids]
            ),
            pixel_values=self.pixel_values,
            image_grid_thw=self.image_grid_thw,
            targets=self.unpack(self.targets),
            target_mask=self.unpack(self.target_mask),
            lengths=[self.sequence_lengths[i] for i in order],
            values={k: self.unpack(v) for k, v in self.values.items()},
        )


def encode_vision(seq: SequenceLike, chat: ChatFormat) -> Vision:
    """Pixels and grids of a sequence's images, encoded as the engine encoded them: the
    engine's own ``Frames`` where the sequence kept them for all its images
    (``Trajectory.frames``), else encoded from the images."""
    if not seq.images:
        return None, None
    kept = getattr(seq, "frames", None)
    if kept and sum(len(f) for f in kept) == len(seq.images):
        frames = cat_pixels(kept)
        if isinstance(frames, Frames):
            return frames, frames.grid()
    return chat.encode_frames(list(seq.images))


def target_values(values: Sequence[float] | Tensor, length: int, name: str = "values") -> Tensor:
    """Per-target values of a sequence of ``length`` tokens, as float32 ``[length - 1]``.

    Accepts either alignment, told apart by size: ``length`` entries are token-aligned (the
    first is dropped), ``length - 1`` entries are already target-aligned.
    """
    t = torch.as_tensor(values, dtype=torch.float32).detach().cpu()
    if t.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional per sequence, got shape {tuple(t.shape)}")
    if t.numel() == length:
        return t[1:]
    if t.numel() == length - 1:
        return t
    raise ValueError(
        f"{name} has {t.numel()} entries for a sequence of {length} tokens; expected {length} "
        f"(one per token) or {length - 1} (one per target token)"
    )


def _check_sequence(seq: SequenceLike, grid: Tensor | None, chat: ChatFormat, index: int) -> None:
    n = len(seq.token_ids)
    if n < 2:
        raise ValueError(f"sequence {index} has {n} tokens; training needs at least 2")
    if len(seq.loss_mask) != n:
        raise ValueError(
            f"sequence {index} has {n} tokens but a loss mask of {len(seq.loss_mask)} entries"
        )
    placeholders = list(seq.token_ids).count(chat.image_token_id)
    expected = 0 if grid is None else chat.image_token_count(grid)
    if placeholders != expected:
        # Caught here: the model would fail later with an opaque shape error.
        raise ValueError(
            f"sequence {index} holds {placeholders} image placeholder tokens but its "
            f"{len(seq.images)} images make {expected}"
        )


def collate(
    seqs: Sequence[SequenceLike],
    chat: ChatFormat,
    *,
    vision: Sequence[Vision] | None = None,
    values: Mapping[str, Sequence[Tensor]] | None = None,
    pack: bool = False,
    row_width: int | None = None,
) -> ModelBatch:
    """Pad ``seqs`` into one batch.

    ``vision``: each sequence's encoded images (from ``encode_vision``), to avoid
    re-encoding in every epoch; encoded here when None. ``values``: per-target tensors
    (see ``target_values``) by name, one per sequence. ``pack``: lay several sequences end
    to end in a row as wide as the longest (``pack_rows``), each at its own positions and
    attending only to itself (``ModelBatch.document``), so a batch of mixed lengths spends
    no compute on padding between short sequences. Logprobs and token sums are those of the
    unpacked batch; a loss that reduces per sequence reads ``ModelBatch.unpacked()``.
    ``row_width``: pack into rows of this many tokens instead (the sum of the lengths puts
    every sequence in one row, with no padding at all).
    """
    if not seqs:
        raise ValueError("cannot collate an empty list of sequences")
    if vision is None:
        vision = [encode_vision(s, chat) for s in seqs]
    lengths = [len(s.token_ids) for s in seqs]
    layout = (
        pack_rows(lengths, row_width or max(lengths)) if pack else [[i] for i in range(len(seqs))]
    )
    width = max(sum(lengths[i] for i in members) for members in layout)
    b = len(layout)
    input_ids = torch.full((b, width), chat.pad_id, dtype=torch.long)
    attention_mask = torch.zeros(b, width, dtype=torch.long)
    # Padding keeps position 0: it is masked out of attention, so its position is never used.
    position_ids = torch.zeros(3, b, width, dtype=torch.long)
    loss_mask = torch.zeros(b, width, dtype=torch.float32)
    document = torch.full((b, width), -1, dtype=torch.long) if pack else None
    windowed = pack or any(getattr(seq, "image_window", None) for seq in seqs)
    hidden_below = torch.zeros(b, width, dtype=torch.long) if windowed else None
    image_of_key = torch.full((b, width), -1, dtype=torch.long) if windowed else None
    padded = {name: torch.zeros(b, width - 1, dtype=torch.float32) for name in values or {}}
    pix: list[Pixels] = []
    grids: list[Tensor] = []
    row_lengths = []
    for row, members in enumerate(layout):
        off = 0
        for doc, i in enumerate(members):
            seq, (pixels, grid), n = seqs[i], vision[i], lengths[i]
            _check_sequence(seq, grid, chat, i)
            if pack and seq.loss_mask[0]:
                # Its first token would be a target of the sequence before it in the row.
                raise ValueError(f"sequence {i} starts inside the loss mask; it cannot be packed")
            cols = slice(off, off + n)
            # Through numpy: a list converts several times faster than torch.tensor's.
            input_ids[row, cols] = torch.from_numpy(np.asarray(seq.token_ids, dtype=np.int64))
            attention_mask[row, cols] = 1
            position_ids[:, row, cols] = sequence_positions(
                list(seq.token_ids), grid, chat.image_token_id, chat.merge_size
            )
            loss_mask[row, cols] = torch.from_numpy(np.asarray(seq.loss_mask, dtype=np.float32))
            if document is not None:
                document[row, cols] = doc
            if k := getattr(seq, "image_window", None):
                below, images = hiding_vectors(
                    list(seq.token_ids), seq.chunk_starts, chat.image_token_id, k
                )
                hidden_below[row, cols] = below
                image_of_key[row, cols] = images
            for name, per_seq in (values or {}).items():
                padded[name][row, off : off + n - 1] = target_values(per_seq[i], n, name)
            if pixels is not None and grid is not None:
                pix.append(pixels)
                grids.append(grid)
            off += n
        row_lengths.append(off)
    return ModelBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        pixel_values=cat_pixels(pix) if pix else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        targets=input_ids[:, 1:].clone(),
        target_mask=loss_mask[:, 1:].clone(),
        lengths=row_lengths,
        values=padded,
        hidden_below=hidden_below,
        image_of_key=image_of_key,
        document=document,
        members=layout if pack else None,
        sequence_lengths=lengths if pack else None,
    )
