"""The policy's forward at the loss-mask targets: per-token logprobs and micro-batch planning.

Logprobs are computed the way the engine samples: the vision placeholder ids are masked to
-inf and the logits divided by the sampling temperature before ``log_softmax``, so the
PPO ratio is exactly 1 (up to float error) at the first update; when the rollouts were
sampled with ``allowed_tokens``, every other id is masked too, as the engine masked it.
Only the positions whose target is a loss-mask token go through the output projection:
every loss here is masked to generated tokens, and image and prompt tokens are most of an
episode, so projecting them onto the vocabulary would be the largest tensor of the step for
nothing. Values returned off the loss mask are therefore 0.

``PolicyForward`` holds what these passes need beside the model (the chat format, the
banned and allowed ids, the compute dtype) and forms the micro-batches of a list of
sequences: by count, by a token budget, packed into rows or one padding-free row each.
``clew.train.worker.PolicyWorker`` builds on it with the optimizer and the updates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import transformers.modeling_utils
from torch import Tensor

from clew.algorithms import logprobs_from_logits
from clew.errors import ClewError
from clew.models.chat import ChatFormat
from clew.models.logit_masks import AllowedIds, banned_token_ids, keep_allowed, mask_banned
from clew.models.packed_attention import packed_attention
from clew.models.pixels import as_patches
from clew.models.precision import bf16_autocast
from clew.models.token_logprobs import token_logprobs
from clew.train.micro_batches import micro_batches as chunked
from clew.train.micro_batches import pack_rows, token_micro_batches
from clew.train.model_batch import (
    ModelBatch,
    SequenceLike,
    Vision,
    collate,
    encode_vision,
    to_device,
)
from clew.train.objectives import TargetOutputs
from clew.train.settings import WorkerSettings

__all__ = ["BOOLEAN_LOGITS_TO_KEEP", "PolicyForward", "hidden_at", "logits_at"]

# Whether the model's forward takes a boolean [B, L] ``logits_to_keep`` (transformers >= 5.2x).
BOOLEAN_LOGITS_TO_KEEP = hasattr(transformers.modeling_utils, "slice_logits_to_keep")


def _run(
    model: torch.nn.Module,
    batch: ModelBatch,
    keep: Tensor,
    dtype: torch.dtype,
    logits_to_keep: Tensor,
    flex: bool = False,
) -> Any:
    """The model's forward on ``batch``; a packed batch's attention must have kept to each
    sequence (``clew.models.packed_attention``), which is checked, as it fails silently.
    ``flex``: the mask is FlexAttention's block mask (``trainer.flex_attention``)."""
    inputs = batch.model_inputs(keep.device, dtype, flex=flex)
    out = model(**inputs, logits_to_keep=logits_to_keep, use_cache=False)
    layout = inputs.get("packed_layout")
    if layout is not None and layout.calls == 0:
        raise ClewError(
            "a packed batch's attention ignored its layout, so its sequences saw each other; "
            "run the forward inside clew.models.packed_attention.packed_attention(model)"
        )
    return out


def logits_at(
    model: torch.nn.Module,
    batch: ModelBatch,
    keep: Tensor,
    dtype: torch.dtype,
    keep_host: Tensor | None = None,
    flex: bool = False,
) -> Tensor:
    """The model's logits ``[K, V]`` at the K positions where ``keep [B, L]`` is True, row-major.

    Only those positions go through the output projection (see the module docstring).
    ``dtype`` is the dtype attention computes in (for the additive attention mask).
    ``keep_host``: ``keep`` on the host, where the positions are then found without
    waiting for the device. ``flex``: as ``_run``'s.
    """
    if BOOLEAN_LOGITS_TO_KEEP:
        return _run(model, batch, keep, dtype, keep, flex).logits
    # Older transformers (5.17, the oldest supported) take only positions shared by the whole
    # batch; project the union of the rows' positions there and pick each row's own.
    host = keep.cpu() if keep_host is None else keep_host
    cols = host.any(0).nonzero().squeeze(-1)
    picked = host[:, cols].reshape(-1).nonzero().squeeze(-1)
    out = _run(model, batch, keep, dtype, to_device(cols, keep.device), flex)
    logits = out.logits.reshape(-1, out.logits.shape[-1])
    return logits.index_select(0, to_device(picked, keep.device))


def hidden_at(
    model: torch.nn.Module,
    batch: ModelBatch,
    keep: Tensor,
    dtype: torch.dtype,
    flex: bool = False,
) -> Tensor:
    """The language model's final hidden states ``[K, H]`` (after its last norm: what the
    output projection reads) at the K positions where ``keep [B, L]`` is True, row-major.
    No position goes through the output projection. ``flex``: as ``_run``'s."""
    if not hasattr(model, "get_decoder"):
        raise ClewError(f"{type(model).__name__} does not name its language model (get_decoder)")
    captured: list[Tensor] = []

    def grab(module: torch.nn.Module, args: Any, output: Any) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        captured.append(output[0] if hidden is None else hidden)

    nothing = (
        torch.zeros_like(keep) if BOOLEAN_LOGITS_TO_KEEP else keep.new_zeros(0, dtype=torch.long)
    )
    handle = model.get_decoder().register_forward_hook(grab)
    try:
        out = _run(model, batch, keep, dtype, nothing, flex)
    finally:
        handle.remove()
    # Plus 0 times the model's own (empty) logits: its output stays first in backward, as
    # when the logits are the loss's input. A sharded model's root begins its backward
    # (FSDP's pre-backward hook on the output) there on every worker; otherwise it begins
    # wherever a gradient first reaches another output (image features), and workers with
    # and without images would run their collectives in different orders.
    return captured[-1][keep] + out.logits.sum() * 0.0


class PolicyForward:
    """The policy's passes over sequences: logprobs at their loss-mask targets, micro-batches."""

    def __init__(self, model: torch.nn.Module, chat: ChatFormat, settings: WorkerSettings) -> None:
        self.model = model
        self.chat = chat
        self.settings = settings
        self.device = next(model.parameters()).device
        self.banned = banned_token_ids(chat).to(self.device)
        self.allowed_ids = AllowedIds(chat, self.device)
        dtype = next(model.parameters()).dtype
        self.dtype = dtype
        self.autocast = settings.autocast_bf16 or (
            self.device.type == "cuda" and dtype == torch.bfloat16
        )
        # The dtype attention computes in, which an additive attention mask must match.
        self.compute_dtype = torch.bfloat16 if self.autocast else dtype

    def _autocast(self) -> contextlib.AbstractContextManager:
        return bf16_autocast(self.device, self.autocast)

    @staticmethod
    def _keep(batch: ModelBatch) -> Tensor:
        """Bool ``[B, L]`` on the host: the positions whose next token is a loss-mask target."""
        keep = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
        keep[:, :-1] = batch.target_mask > 0
        return keep

    def _target_logits(
        self, model: torch.nn.Module, batch: ModelBatch, allowed: tuple[str, ...] = ()
    ) -> Tensor:
        """Logits ``[K, V]`` (float32, banned ids at -inf) at the K loss-mask targets, row-major;
        with ``allowed`` (the rollouts' ``allowed_tokens``) every other id at -inf too."""
        keep = self._keep(batch)
        with self._autocast():
            logits = logits_at(
                model,
                batch,
                to_device(keep, self.device),
                self.compute_dtype,
                keep_host=keep,
                flex=self.settings.flex_attention,
            )
        logits = mask_banned(logits.float(), self.banned)
        return keep_allowed(logits, self.allowed_ids(allowed)) if allowed else logits

    def _forward(
        self,
        model: torch.nn.Module,
        batch: ModelBatch,
        temperature: float,
        allowed: tuple[str, ...] = (),
        with_entropy: bool = False,
    ) -> TargetOutputs:
        """The policy at ``batch``'s loss-mask targets. With ``logprobs_chunk_size`` set, the
        logprobs (and, ``with_entropy``, the entropies) come chunk by chunk from the final
        hidden states (``clew.models.token_logprobs``) and no ``[K, V]`` logits are kept."""
        on_host = batch.target_mask > 0
        mask = to_device(on_host, self.device)
        targets = to_device(batch.targets[on_host], self.device)
        entropy = greedy = logits = None
        if chunk := self.settings.logprobs_chunk_size:
            with self._autocast():
                keep = to_device(self._keep(batch), self.device)
                hidden = hidden_at(
                    model, batch, keep, self.compute_dtype, self.settings.flex_attention
                )
                out = token_logprobs(
                    hidden,
                    model.get_output_embeddings(),
                    targets,
                    banned=self.banned,
                    allowed=self.allowed_ids(allowed) if allowed else None,
                    temperature=temperature,
                    chunk_size=chunk,
                    with_entropy=with_entropy,
                )
            logprobs, entropy, greedy = out.logprobs, out.entropy, out.greedy
        else:
            logits = self._target_logits(model, batch, allowed)
            logprobs = logprobs_from_logits(logits[None], targets[None], temperature=temperature)[0]
        per_target = torch.zeros(mask.shape, dtype=logprobs.dtype, device=self.device)
        per_target = per_target.masked_scatter(mask, logprobs)
        return TargetOutputs(logits, logprobs, per_target, targets, entropy, greedy)

    def vision(self, seqs: Sequence[SequenceLike]) -> list[Vision]:
        """The images of ``seqs`` as the forward reads them, encoded once for every pass."""
        vision = [encode_vision(s, self.chat) for s in seqs]
        if self.device.type == "cpu":
            # No device to hand the patching to: patch once here rather than at every
            # forward that reuses these images (logprobs, each micro-batch and epoch).
            vision = [(None if p is None else as_patches(p), g) for p, g in vision]
        return vision

    @staticmethod
    def _by_length(seqs: Sequence[SequenceLike], indices: Sequence[int]) -> list[int]:
        # Micro-batches of similar lengths waste less compute on padding; the order of
        # sequences inside a mini-batch changes nothing in its (summed) gradient.
        return sorted(indices, key=lambda i: len(seqs[i].token_ids))

    def _micro_batches(
        self, seqs: Sequence[SequenceLike], indices: Sequence[int], size: int, pack: bool
    ) -> list[list[int]]:
        """Sequence indices of each micro-batch.

        ``size`` sequences, sorted by length; with ``max_tokens_per_microbatch``, as many as
        fit that many tokens instead (padded tokens counted, or with ``remove_padding`` the
        sum of the lengths: ``token_micro_batches``). ``pack`` (SFT's packed rows, without
        ``remove_padding``): the sequences of ``size`` rows as wide as the longest, packed over
        the whole mini-batch (packing only inside micro-batches already sorted by length
        finds little room); a token budget counts those rows' tokens.
        """
        budget = self.settings.max_tokens_per_microbatch
        lengths = [len(seqs[i].token_ids) for i in indices]
        if pack and not self.settings.remove_padding:
            order = list(indices)  # pack_rows sorts by length itself
            rows = pack_rows(lengths, max(lengths))
            per = max(1, budget // max(lengths)) if budget else size
            return [[order[j] for row in chunk for j in row] for chunk in chunked(rows, per)]
        if budget:
            padded = not self.settings.remove_padding
            return token_micro_batches(list(indices), lengths, budget, padded=padded)
        return chunked(self._by_length(seqs, indices), size)

    def _collate(
        self,
        seqs: Sequence[SequenceLike],
        idx: Sequence[int],
        vision: Sequence[Vision],
        values: dict[str, Sequence[Tensor]] | None = None,
        pack: bool = False,
    ) -> ModelBatch:
        """The micro-batch ``seqs[idx]``: one packed row with ``remove_padding``, packed rows
        with ``pack``, else right-padded."""
        chosen = [seqs[i] for i in idx]
        row_width = None
        if self.settings.remove_padding:
            pack, row_width = True, sum(len(s.token_ids) for s in chosen)
        return collate(
            chosen,
            self.chat,
            vision=[vision[i] for i in idx],
            values={k: [v[i] for i in idx] for k, v in (values or {}).items()},
            pack=pack,
            row_width=row_width,
        )

    def _packing(
        self, model: torch.nn.Module, pack: bool = False
    ) -> contextlib.AbstractContextManager:
        """Per-sequence attention for the block when its batches may be packed, and every
        forward's through FlexAttention with ``flex_attention``."""
        flex = self.settings.flex_attention
        if pack or self.settings.remove_padding or flex:
            return packed_attention(model, flex=flex)
        return contextlib.nullcontext()
