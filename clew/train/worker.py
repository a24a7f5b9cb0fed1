"""The policy worker: one model, its optimizer, and the forward/backward passes of training.

A plain class so that it can be tested and used in one process; a Ray actor later wraps
it behind the same methods. It owns the model the rollout engine samples from (the very
module object, so weights never need syncing) and puts it back in eval mode after every
update, which is the mode the engine expects.

Logprobs are computed the way the engine samples: the vision placeholder ids are masked to
-inf and the logits divided by the sampling temperature before ``log_softmax``, so the
PPO ratio is exactly 1 (up to float error) at the first update; when the rollouts were
sampled with ``allowed_tokens``, every other id is masked too, as the engine masked it.
Only the positions whose target is a loss-mask token go through the output projection:
every loss here is masked to generated tokens, and image and prompt tokens are most of an
episode, so projecting them onto the vocabulary would be the largest tensor of the step for
nothing. Values the worker returns off the loss mask are therefore 0.

The KL reference: with LoRA it is the base model with the adapter switched off
(``disable_adapter``), which costs no memory. Without LoRA it is a frozen copy of the
initial weights, taken when the worker is built (``WorkerSettings.kl_reference``) or at the
first reference call before any optimizer step; it doubles the model's memory, so it is
only made when KL is used.

Data parallelism: with ``sync`` set (``clew.cluster.data_parallel.GradSync``), each worker
holds its share of every mini-batch, scales its losses by the mini-batch's counts over all
workers and sums the gradients over them before clipping, so every worker takes the step
one worker would take on the whole mini-batch. A policy sharded with FSDP
(``clew.cluster.fsdp``) has its gradients summed by FSDP itself in backward; every worker
then runs the same number of passes, and scores and samples with the weights gathered.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers.modeling_utils
from torch import Tensor

from clew.algorithms import LogprobGap, logprobs_from_logits
from clew.cluster import fsdp
from clew.errors import ClewError
from clew.models import count_parameters, load_policy
from clew.models.chat import ChatFormat
from clew.models.logit_masks import AllowedIds, banned_token_ids, keep_allowed, mask_banned
from clew.models.packed_attention import packed_attention
from clew.models.pixels import as_patches
from clew.models.precision import bf16_autocast
from clew.models.token_logprobs import token_logprobs
from clew.train.batch import (
    ModelBatch,
    Sample,
    SequenceLike,
    Vision,
    collate,
    encode_vision,
    pack_rows,
    token_micro_batches,
)
from clew.train.batch import micro_batches as chunked
from clew.train.logprob_guard import gap_of_scores, guard_metrics, observing
from clew.train.lora import apply_lora, is_lora
from clew.train.objectives import Objective, TargetOutputs, ppo_objective, sft_objective
from clew.train.optim import build_optimizer, clipped_step, to_cpu
from clew.train.settings import PPOSettings, WorkerSettings
from clew.train.training_batch import TrainingBatch

if TYPE_CHECKING:
    from clew.cluster.data_parallel import GradSync

__all__ = ["PPOSettings", "PolicyWorker", "TrainingBatch", "WorkerSettings", "apply_lora"]

# Whether the model's forward takes a boolean [B, L] ``logits_to_keep`` (transformers >= 5.2x).
BOOLEAN_LOGITS_TO_KEEP = hasattr(transformers.modeling_utils, "slice_logits_to_keep")


def _run(
    model: torch.nn.Module,
    batch: ModelBatch,
    keep: Tensor,
    dtype: torch.dtype,
    logits_to_keep: Tensor,
) -> Any:
    """The model's forward on ``batch``; a packed batch's attention must have kept to each
    sequence (``clew.models.packed_attention``), which is checked, as it fails silently."""
    inputs = batch.model_inputs(keep.device, dtype)
    out = model(**inputs, logits_to_keep=logits_to_keep, use_cache=False)
    layout = inputs.get("packed_layout")
    if layout is not None and layout.calls == 0:
        raise ClewError(
            "a packed batch's attention ignored its layout, so its sequences saw each other; "
            "run the forward inside clew.models.packed_attention.packed_attention(model)"
        )
    return out


def logits_at(
    model: torch.nn.Module, batch: ModelBatch, keep: Tensor, dtype: torch.dtype
) -> Tensor:
    """The model's logits ``[K, V]`` at the K positions where ``keep [B, L]`` is True, row-major.

    Only those positions go through the output projection (see the module docstring).
    ``dtype`` is the dtype attention computes in (for the additive attention mask).
    """
    # Older transformers (5.17 on the GPU image) take only positions shared by the whole
    # batch; project the union of the rows' positions there and pick each row's own.
    cols = None if BOOLEAN_LOGITS_TO_KEEP else keep.any(0).nonzero().squeeze(-1)
    out = _run(model, batch, keep, dtype, keep if cols is None else cols)
    return out.logits if cols is None else out.logits[keep[:, cols]]


def hidden_at(
    model: torch.nn.Module, batch: ModelBatch, keep: Tensor, dtype: torch.dtype
) -> Tensor:
    """The language model's final hidden states ``[K, H]`` (after its last norm: what the
    output projection reads) at the K positions where ``keep [B, L]`` is True, row-major.
    No position goes through the output projection."""
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
        out = _run(model, batch, keep, dtype, nothing)
    finally:
        handle.remove()
    # Plus 0 times the model's own (empty) logits: its output stays first in backward, as
    # when the logits are the loss's input. A sharded model's root begins its backward
    # (FSDP's pre-backward hook on the output) there on every worker; otherwise it begins
    # wherever a gradient first reaches another output (image features), and workers with
    # and without images would run their collectives in different orders.
    return captured[-1][keep] + out.logits.sum() * 0.0


class PolicyWorker:
    """Owns the policy (optionally LoRA-wrapped), AdamW and the LR schedule."""

    def __init__(
        self, model: torch.nn.Module, chat: ChatFormat, settings: WorkerSettings | None = None
    ) -> None:
        self.settings = settings = settings or WorkerSettings()
        if settings.gradient_checkpointing:
            # Non-reentrant checkpointing needs no input that requires grad, so it also works
            # when LoRA has frozen the embeddings. Newer transformers renamed the method.
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        if settings.lora_rank > 0:
            model = apply_lora(
                model,
                settings.lora_rank,
                settings.lora_alpha,
                settings.lora_dropout,
                settings.lora_target_modules,
            )
        else:
            model.requires_grad_(True)
        self.model = model
        self.chat = chat
        self.device = next(model.parameters()).device
        self.lora = is_lora(model)
        self.banned = banned_token_ids(chat).to(self.device)
        self.allowed_ids = AllowedIds(chat, self.device)
        dtype = next(model.parameters()).dtype
        self.dtype = dtype
        self.autocast = settings.autocast_bf16 or (
            self.device.type == "cuda" and dtype == torch.bfloat16
        )
        # The dtype attention computes in, which an additive attention mask must match.
        self.compute_dtype = torch.bfloat16 if self.autocast else dtype
        self.optimizer, self.scheduler = build_optimizer(model, settings)
        self.optimizer_steps = 0
        self.sync: GradSync | None = None  # set by a data-parallel wrapper
        self.reference: torch.nn.Module | None = None
        if settings.kl_reference and not self.lora:
            self.ensure_reference()
        self.model.eval()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        settings: WorkerSettings | None = None,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        system_prompt: str | None = None,
    ) -> PolicyWorker:
        model, processor = load_policy(path, dtype, device)
        return cls(model, ChatFormat(processor, system_prompt), settings)

    def trainable_parameters(self) -> int:
        return count_parameters(self.model, trainable_only=True)

    def ensure_reference(self) -> None:
        """Keep a frozen copy of the current weights as the KL reference (full fine-tuning)."""
        if self.lora or self.reference is not None:
            return
        if fsdp.is_sharded(self.model):
            raise ClewError(
                "a sharded policy cannot be copied as the KL reference; build the worker with "
                "WorkerSettings(kl_reference=True) so the copy is taken before sharding"
            )
        if self.optimizer_steps:
            raise ClewError(
                "the KL reference must be the initial policy, but the model has already taken "
                f"{self.optimizer_steps} optimizer steps; build the worker with "
                "WorkerSettings(kl_reference=True) or use LoRA (the reference is then the base "
                "model with the adapter off)"
            )
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)

    @contextlib.contextmanager
    def _policy(self, adapter_enabled: bool) -> Iterator[torch.nn.Module]:
        if adapter_enabled:
            yield self.model
        elif self.lora:
            with self.model.disable_adapter():
                yield self.model
        else:
            self.ensure_reference()
            assert self.reference is not None
            yield self.reference

    def _autocast(self) -> contextlib.AbstractContextManager:
        return bf16_autocast(self.device, self.autocast)

    def _keep(self, batch: ModelBatch) -> Tensor:
        """Bool ``[B, L]``: the positions whose next token is a loss-mask target."""
        keep = torch.zeros(batch.input_ids.shape, dtype=torch.bool, device=self.device)
        keep[:, :-1] = (batch.target_mask > 0).to(self.device)
        return keep

    def _target_logits(
        self, model: torch.nn.Module, batch: ModelBatch, allowed: tuple[str, ...] = ()
    ) -> Tensor:
        """Logits ``[K, V]`` (float32, banned ids at -inf) at the K loss-mask targets, row-major;
        with ``allowed`` (the rollouts' ``allowed_tokens``) every other id at -inf too."""
        keep = self._keep(batch)
        with self._autocast():
            logits = logits_at(model, batch, keep, self.compute_dtype)
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
        mask = (batch.target_mask > 0).to(self.device)
        targets = batch.targets.to(self.device)[mask]
        entropy = greedy = logits = None
        if chunk := self.settings.logprobs_chunk_size:
            with self._autocast():
                hidden = hidden_at(model, batch, self._keep(batch), self.compute_dtype)
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

    def _vision(self, seqs: Sequence[SequenceLike]) -> list[Vision]:
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
        """Per-sequence attention for the block when its batches may be packed."""
        if pack or self.settings.remove_padding:
            return packed_attention(model)
        return contextlib.nullcontext()

    @torch.no_grad()
    def compute_logprobs(
        self,
        seqs: Sequence[SequenceLike],
        temperature: float = 1.0,
        micro_batch_size: int = 8,
        adapter_enabled: bool = True,
        allowed: tuple[str, ...] = (),
    ) -> list[Tensor]:
        """Per sequence, float32 CPU ``[len - 1]``: the logprob of ``token_ids[1:]`` (0 off the mask).

        ``adapter_enabled=False`` gives the KL reference's logprobs (see the module docstring);
        ``allowed``: the rollouts' ``allowed_tokens``. Micro-batches are formed as the
        update forms them (``max_tokens_per_microbatch``, ``remove_padding``).
        """
        self.model.eval()
        out: list[Tensor] = [torch.zeros(0)] * len(seqs)
        vision = self._vision(seqs)
        plan = self._micro_batches(seqs, range(len(seqs)), micro_batch_size, pack=False)
        with (
            self._policy(adapter_enabled) as model,
            fsdp.gathered(model),
            self._packing(model),
        ):
            for idx in plan:
                batch = self._collate(seqs, idx, vision)
                out_b = self._forward(model, batch, temperature, allowed).per_target.cpu()
                for i, row in zip(idx, batch.per_sequence(out_b), strict=True):
                    out[i] = row.clone()
        return out

    def _accumulate(
        self,
        seqs: Sequence[SequenceLike],
        indices: Sequence[int],
        vision: Sequence[Vision],
        values: dict[str, Sequence[Tensor]],
        micro_batch_size: int,
        objective: Objective,
        temperature: float,
        by_tokens: bool,
        pack: bool = False,
        allowed: tuple[str, ...] = (),
    ) -> dict[str, float] | None:
        """Zero the grads and backpropagate the loss of ``seqs[indices]`` over micro-batches.

        Each micro-batch's loss is reduced over the micro-batch and scaled by its share of
        the mini-batch (``by_tokens``: its share of loss-mask tokens, for ``token_mean``;
        else its share of sequences, for the per-sequence reductions), so the accumulated
        gradient is that of the mini-batch loss whatever the micro-batch size. Statistics
        are token-weighted means, except ``loss`` which is the mini-batch loss. None when the
        mini-batch has no loss-mask token (nothing to learn from). ``pack`` packs the
        mini-batch's sequences into rows (``_micro_batches``, ``collate``); a micro-batch is
        then ``micro_batch_size`` packed rows. With ``remove_padding`` each micro-batch is
        one packed row. The objective sees a packed micro-batch one sequence a row
        (``ModelBatch.unpacked``), so any reduction gives the loss of the padded layout.
        A sharded policy runs ``fsdp.lockstep``: micro-batches with no loss-mask token give
        way to passes with no loss, on a two-token sequence, as many as the workers need.
        """
        self.optimizer.zero_grad(set_to_none=True)
        tokens = {i: sum(seqs[i].loss_mask[1:]) for i in indices}
        local_tokens = sum(tokens.values())
        # Every worker joins these all-reduces, even one with no token of this mini-batch.
        sync = self.sync
        total_tokens = sync.total(local_tokens) if sync is not None else local_tokens
        total_seqs = sync.total(len(indices)) if sync is not None else len(indices)
        if total_tokens == 0:
            return None
        stats: dict[str, float] = {"loss": 0.0, "tokens": float(total_tokens)}
        plan = self._micro_batches(seqs, indices, micro_batch_size, pack) if indices else []
        passes: Iterable[list[int] | None] = plan
        if sharded := fsdp.is_sharded(self.model):
            assert sync is not None, "a sharded policy needs the workers' sync"
            passes = fsdp.lockstep([idx for idx in plan if sum(tokens[i] for i in idx)], sync)
        self.model.train()
        # Backward included: gradient checkpointing recomputes the forwards in it.
        with self._packing(self.model, pack):
            try:
                for idx in passes:
                    if idx is None:
                        self._pass_without_loss()
                        continue
                    n_tok = sum(tokens[i] for i in idx)
                    if n_tok == 0:
                        continue  # contributes exactly 0 to every reduction
                    batch = self._collate(seqs, idx, vision, values, pack)
                    outputs = self._forward(self.model, batch, temperature, allowed, True)
                    if batch.document is not None:
                        per_target = batch.unpack(outputs.per_target)
                        batch, outputs = batch.unpacked(), replace(outputs, per_target=per_target)
                    loss, micro_stats = objective(batch, outputs)
                    share = n_tok / total_tokens if by_tokens else len(idx) / total_seqs
                    scaled = loss * share
                    if sharded:
                        scaled = scaled + fsdp.all_weights(self.model)
                    scaled.backward()
                    stats["loss"] += float(loss.detach()) * share
                    for k, v in micro_stats.items():
                        stats[k] = stats.get(k, 0.0) + v * n_tok / local_tokens
            finally:
                self.model.eval()
        if sync is not None:  # each worker's share of the loss adds up to the mini-batch's
            stats["loss"] = sync.total(stats["loss"])
        return stats

    def _pass_without_loss(self) -> None:
        """Forward and backward on two tokens with a loss of 0: the collectives of a sharded
        policy's pass, for a worker with nothing (more) to learn from in this mini-batch.
        It takes the path the other workers' passes take (``_forward``): with chunked
        logprobs the output projection runs outside the model's forward, and the collectives
        of backward follow from which path the loss came through."""
        token = self.chat.im_end_id
        batch = collate([Sample([token, token], [0, 1])], self.chat)
        logprobs = self._forward(self.model, batch, 1.0).logprobs
        (fsdp.zero_loss(logprobs) + fsdp.all_weights(self.model)).backward()

    def _optimizer_step(self) -> dict[str, float]:
        if self.sync is not None:  # before clipping, so every worker clips the same gradient
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            if replicated := fsdp.replicated(trainable):
                self.sync.reduce_(replicated)
        stats = clipped_step(self.optimizer, self.scheduler, self.settings.max_grad_norm)
        self.optimizer_steps += 1
        return stats

    def _ppo_inputs(
        self, batch: TrainingBatch, settings: PPOSettings
    ) -> tuple[dict[str, Sequence[Tensor]], list[Vision]]:
        """The per-token values of ``batch`` the PPO objective reads, and its images; with
        ``use_kl_loss`` the reference's logprobs too (see the module docstring)."""
        values: dict[str, Sequence[Tensor]] = {
            "old_logprobs": batch.old_logprobs,
            "advantages": batch.token_advantages(),
        }
        if settings.use_kl_loss:
            values["ref_logprobs"] = self.compute_logprobs(
                batch.sequences,
                settings.temperature,
                settings.forward_micro_batch_size,
                adapter_enabled=False,
                allowed=settings.allowed_tokens,
            )
        if settings.recompute_old_logprobs or settings.use_tis:
            # PPO's "old" policy becomes the trainer's forward; the engine's stay for TIS.
            values["rollout_logprobs"] = batch.old_logprobs
            values["old_logprobs"] = self.compute_logprobs(
                batch.sequences,
                settings.temperature,
                settings.forward_micro_batch_size,
                allowed=settings.allowed_tokens,
            )
        return values, self._vision(batch.sequences)

    def _ppo_accumulate(
        self,
        batch: TrainingBatch,
        indices: Sequence[int],
        inputs: tuple[dict[str, Sequence[Tensor]], list[Vision]],
        settings: PPOSettings,
        gap: LogprobGap | None = None,
    ) -> dict[str, float] | None:
        values, vision = inputs
        return self._accumulate(
            batch.sequences,
            indices,
            vision,
            values,
            settings.micro_batch_size,
            observing(ppo_objective(settings), gap),
            settings.temperature,
            settings.loss_reduction == "token_mean",
            allowed=settings.allowed_tokens,
        )

    def accumulate_gradients(
        self, batch: TrainingBatch, settings: PPOSettings
    ) -> dict[str, float] | None:
        """The PPO gradient of the whole ``batch`` as one mini-batch, left in ``.grad`` (no step)."""
        inputs = self._ppo_inputs(batch, settings)
        return self._ppo_accumulate(batch, range(len(batch)), inputs, settings)

    def train_batch(self, batch: TrainingBatch, settings: PPOSettings) -> dict[str, float]:
        """PPO on ``batch`` as ``settings`` say: ``epochs`` passes, one optimizer step per
        mini-batch. Returns ``policy/*`` metrics, means over the optimizer steps, and the
        engine-against-trainer logprob guard (``clew.train.logprob_guard``)."""
        inputs = self._ppo_inputs(batch, settings)
        gap = gap_of_scores(batch.sequences, inputs[0])
        watch = None if "rollout_logprobs" in inputs[0] else gap
        sizes = settings.mini_batch_sizes or [
            len(c) for c in chunked(range(len(batch)), settings.mini_batch_size or len(batch) or 1)
        ]
        if sum(sizes) != len(batch):
            raise ValueError(f"mini-batch sizes {list(sizes)} do not add up to {len(batch)}")
        bounds = [0, *itertools.accumulate(sizes)]
        steps: list[dict[str, float]] = []
        for _ in range(settings.epochs):
            for indices in (range(lo, hi) for lo, hi in itertools.pairwise(bounds)):
                stats = self._ppo_accumulate(batch, indices, inputs, settings, watch)
                if stats is not None:
                    steps.append(stats | self._optimizer_step())
                    watch = None  # the weights are no longer those the engine sampled with
        keys = ("loss", "clip_fraction", "approx_kl", "kl_loss", "entropy", "grad_norm", "lr")
        keys += ("tis_weight_mean", "tis_capped_fraction") if settings.use_tis else ()
        out = {f"policy/{k}": _mean(steps, k) for k in keys}
        out |= guard_metrics(gap, None if self.sync is None else self.sync.total)
        out["policy/optimizer_steps"] = float(len(steps))
        out["policy/skipped_steps"] = sum(s["skipped"] for s in steps)
        return out

    def sft_step(self, seqs: Sequence[SequenceLike], micro_batch_size: int) -> dict[str, float]:
        """One optimizer step of cross-entropy on loss-mask tokens (token mean over ``seqs``).

        The logprobs are the sampler's (banned vision ids masked, temperature 1), so SFT
        trains the distribution the engine samples from.
        """
        indices = range(len(seqs))
        stats = self._accumulate(
            seqs, indices, self._vision(seqs), {}, micro_batch_size, sft_objective, 1.0, True,
            pack=self.settings.pack_sequences,
        )  # fmt: skip
        if stats is None:
            raise ValueError("the SFT batch has no loss-mask tokens")
        stats |= self._optimizer_step()
        return {f"sft/{k}": v for k, v in stats.items()}

    def state_dict(self) -> dict[str, Any]:
        """Trainable weights (the adapter only, with LoRA), optimizer and scheduler, on CPU.

        A sharded policy's workers must all call this; worker 0 gets the state with whole
        tensors, the others an empty dict.
        """
        if fsdp.is_sharded(self.model):
            return fsdp.full_state(self, keep=_rank() == 0)
        return {
            "trainable": {
                n: p.detach().to("cpu", copy=True)
                for n, p in self.model.named_parameters()
                if p.requires_grad
            },
            "optimizer": to_cpu(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "optimizer_steps": self.optimizer_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if fsdp.is_sharded(self.model):
            fsdp.load_full_state(self, state)
            return
        params = dict(self.model.named_parameters())
        trainable = state["trainable"]
        missing = sorted(n for n, p in params.items() if p.requires_grad and n not in trainable)
        unknown = sorted(n for n in trainable if n not in params)
        if missing or unknown:
            raise ClewError(
                "the worker state does not fit this model (different LoRA settings or "
                f"architecture?): missing {missing[:3]}, unexpected {unknown[:3]}"
            )
        with torch.no_grad():
            for n, t in trainable.items():
                params[n].copy_(t)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = int(state.get("optimizer_steps", 0))

    def save_pretrained(self, directory: str | Path, merged: bool = False) -> Path:
        """Save the adapter (LoRA) or the full model; ``merged`` writes LoRA merged into full weights.

        Merging works on a copy (the worker keeps training its adapter), so it briefly needs
        a second model's memory. A sharded policy's workers must all call this; worker 0
        writes the whole weights.
        """
        directory = Path(directory)
        if fsdp.is_sharded(self.model):
            whole = fsdp.full_model_state(self.model, keep=_rank() == 0)
            if whole:
                directory.mkdir(parents=True, exist_ok=True)
                self.model.save_pretrained(directory, state_dict=whole)
            return directory
        directory.mkdir(parents=True, exist_ok=True)
        if self.lora and merged:
            full = copy.deepcopy(self.model).merge_and_unload()
            full.save_pretrained(directory)
            del full
        else:
            self.model.save_pretrained(directory)
        return directory


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _mean(rows: list[dict[str, float]], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else 0.0
