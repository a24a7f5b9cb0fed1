"""The policy worker: one model, its optimizer, and the forward/backward passes of training.

A plain class so that it can be tested and used in one process; a Ray actor later wraps
it behind the same methods. It owns the model the rollout engine samples from (the very
module object, so weights never need syncing) and puts it back in eval mode after every
update, which is the mode the engine expects.

Its face: ``compute_logprobs`` (scoring), ``train_batch`` (a PPO update) and ``sft_step``,
built on two primitives that an update loop calls, ``accumulate`` (one mini-batch's
gradient over micro-batches, from a ``GradientPass``) and ``optimizer_step``; then the
state methods and ``save_pretrained``. The worker's parts live beside it: the forward at
the loss-mask targets and the micro-batch plans in ``clew.train.forward`` (its base class),
the PPO update in ``clew.train.ppo_update``, its state and exported weights in
``clew.train.worker_state``.

The KL reference: with LoRA it is the base model with the adapter switched off
(``disable_adapter``), which costs no memory. Without LoRA it is a frozen copy of the
initial weights, taken when the worker is built (``WorkerSettings.kl_reference``) or at the
first reference call before any optimizer step; it doubles the model's memory, so it is
only made when KL is used.

Data parallelism: with ``sync`` set (``clew.train.grad_sync.GradSync``), each worker
holds its share of every mini-batch, scales its losses by the mini-batch's counts over all
workers and sums the gradients over them before clipping, so every worker takes the step
one worker would take on the whole mini-batch. A policy sharded with FSDP
(``clew.train.fsdp``) has its gradients summed by FSDP itself in backward; every worker
then runs the same number of passes, and scores and samples with the weights gathered.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from clew.errors import ClewError
from clew.kernels.sdpa_backends import without_cudnn_attention
from clew.models import count_parameters, load_policy
from clew.models.chat import ChatFormat
from clew.train import fsdp
from clew.train.forward import PolicyForward
from clew.train.lora import apply_lora, is_lora
from clew.train.model_batch import Sample, SequenceLike, collate
from clew.train.objectives import GradientPass, sft_objective
from clew.train.optim import build_optimizer, clipped_step
from clew.train.ppo_update import accumulate_ppo_gradients, train_ppo
from clew.train.settings import PPOSettings, WorkerSettings
from clew.train.training_batch import TrainingBatch
from clew.train.worker_state import load_worker_state, save_policy, worker_state

if TYPE_CHECKING:
    from clew.train.grad_sync import GradSync


def _exact(value: Tensor | float) -> Tensor | float:
    """A statistic to add up: a tensor (detached) in float64, as the Python float it would
    be read as, so a sum on the device equals the sum of the floats; a float as it is."""
    return value.detach().double() if isinstance(value, Tensor) else float(value)


def _read_stats(stats: dict[str, Tensor | float]) -> dict[str, float]:
    """``stats`` as Python floats, the tensors among them read in one device-to-host copy."""
    tensors = {k: v for k, v in stats.items() if isinstance(v, Tensor)}
    if tensors:
        device = next(iter(tensors.values())).device
        read = torch.stack([v.to(device) for v in tensors.values()]).tolist()
        stats = stats | dict(zip(tensors, read, strict=True))
    return {k: float(v) for k, v in stats.items()}


class PolicyWorker(PolicyForward):
    """Owns the policy (optionally LoRA-wrapped), AdamW and the LR schedule."""

    def __init__(
        self, model: torch.nn.Module, chat: ChatFormat, settings: WorkerSettings | None = None
    ) -> None:
        settings = settings or WorkerSettings()
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
        super().__init__(model, chat, settings)
        self.lora = is_lora(model)
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
        vision = self.vision(seqs)
        plan = self._micro_batches(seqs, range(len(seqs)), micro_batch_size, pack=False)
        with (
            self._policy(adapter_enabled) as model,
            fsdp.gathered(model),
            self._packing(model),
            without_cudnn_attention(),
        ):
            for idx in plan:
                batch = self._collate(seqs, idx, vision)
                out_b = self._forward(model, batch, temperature, allowed).per_target.cpu()
                for i, row in zip(idx, batch.per_sequence(out_b), strict=True):
                    out[i] = row.clone()
        return out

    def accumulate(
        self, seqs: Sequence[SequenceLike], indices: Sequence[int], gradient: GradientPass
    ) -> dict[str, float] | None:
        """Zero the grads and backpropagate the loss of ``seqs[indices]`` over micro-batches.

        Each micro-batch's loss is reduced over the micro-batch and scaled by its share of
        the mini-batch (``gradient.by_tokens``: its share of loss-mask tokens, for
        ``token_mean``; else its share of sequences, for the per-sequence reductions), so
        the accumulated gradient is that of the mini-batch loss whatever the micro-batch
        size. Statistics are token-weighted means, except ``loss`` which is the mini-batch
        loss; they add up on the device (in float64) and are read to the host in one copy at
        the end (``_read_stats``), so no micro-batch makes the host wait for the device
        before its backward. None when the mini-batch has no loss-mask token (nothing to
        learn from). ``pack`` packs the mini-batch's sequences into rows (``_micro_batches``,
        ``collate``); a micro-batch is then ``micro_batch_size`` packed rows. With
        ``remove_padding`` each micro-batch is one packed row. The objective sees a packed
        micro-batch one sequence a row (``ModelBatch.unpacked``), so any reduction gives the
        loss of the padded layout.
        A sharded policy runs ``fsdp.lockstep``: micro-batches with no loss-mask token give
        way to passes with no loss, on a two-token sequence, as many as the workers need.
        """
        g = gradient
        self.optimizer.zero_grad(set_to_none=True)
        tokens = {i: sum(seqs[i].loss_mask[1:]) for i in indices}
        local_tokens = sum(tokens.values())
        # Every worker joins these all-reduces, even one with no token of this mini-batch.
        sync = self.sync
        total_tokens = sync.total(local_tokens) if sync is not None else local_tokens
        total_seqs = sync.total(len(indices)) if sync is not None else len(indices)
        if total_tokens == 0:
            return None
        stats: dict[str, Tensor | float] = {"loss": 0.0, "tokens": float(total_tokens)}
        plan = self._micro_batches(seqs, indices, g.micro_batch_size, g.pack) if indices else []
        passes: Iterable[list[int] | None] = plan
        if sharded := fsdp.is_sharded(self.model):
            assert sync is not None, "a sharded policy needs the workers' sync"
            passes = fsdp.lockstep([idx for idx in plan if sum(tokens[i] for i in idx)], sync)
        self.model.train()
        # Backward included: gradient checkpointing recomputes the forwards in it.
        with self._packing(self.model, g.pack), without_cudnn_attention():
            try:
                for idx in passes:
                    if idx is None:
                        self._pass_without_loss()
                        continue
                    n_tok = sum(tokens[i] for i in idx)
                    if n_tok == 0:
                        continue  # contributes exactly 0 to every reduction
                    batch = self._collate(seqs, idx, g.vision, g.values, g.pack)
                    outputs = self._forward(self.model, batch, g.temperature, g.allowed, True)
                    if batch.document is not None:
                        per_target = batch.unpack(outputs.per_target)
                        batch, outputs = batch.unpacked(), replace(outputs, per_target=per_target)
                    loss, micro_stats = g.objective(batch, outputs)
                    share = n_tok / total_tokens if g.by_tokens else len(idx) / total_seqs
                    scaled = loss * share
                    if sharded:
                        scaled = scaled + fsdp.all_weights(self.model)
                    scaled.backward()
                    stats["loss"] += _exact(loss) * share
                    for k, v in micro_stats.items():
                        stats[k] = stats.get(k, 0.0) + _exact(v) * n_tok / local_tokens
            finally:
                self.model.eval()
        out = _read_stats(stats)
        if sync is not None:  # each worker's share of the loss adds up to the mini-batch's
            out["loss"] = sync.total(out["loss"])
        return out

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

    def optimizer_step(self) -> dict[str, float]:
        """Sum the gradients over data-parallel workers, clip them and step: the step's
        ``grad_norm``, ``lr`` and ``skipped`` (``clew.train.optim.clipped_step``)."""
        if self.sync is not None:  # before clipping, so every worker clips the same gradient
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            if replicated := fsdp.replicated(trainable):
                self.sync.reduce_(replicated)
        stats = clipped_step(self.optimizer, self.scheduler, self.settings.max_grad_norm)
        self.optimizer_steps += 1
        return stats

    def accumulate_gradients(
        self, batch: TrainingBatch, settings: PPOSettings
    ) -> dict[str, float] | None:
        """The PPO gradient of the whole ``batch`` as one mini-batch, left in ``.grad`` (no step)."""
        return accumulate_ppo_gradients(self, batch, settings)

    def train_batch(self, batch: TrainingBatch, settings: PPOSettings) -> dict[str, float]:
        """PPO on ``batch`` as ``settings`` say (``clew.train.ppo_update.train_ppo``)."""
        return train_ppo(self, batch, settings)

    def sft_step(self, seqs: Sequence[SequenceLike], micro_batch_size: int) -> dict[str, float]:
        """One optimizer step of cross-entropy on loss-mask tokens (token mean over ``seqs``).

        The logprobs are the sampler's (banned vision ids masked, temperature 1), so SFT
        trains the distribution the engine samples from.
        """
        gradient = GradientPass(
            sft_objective, self.vision(seqs), micro_batch_size, pack=self.settings.pack_sequences
        )
        stats = self.accumulate(seqs, range(len(seqs)), gradient)
        if stats is None:
            raise ValueError("the SFT batch has no loss-mask tokens")
        stats |= self.optimizer_step()
        return {f"sft/{k}": v for k, v in stats.items()}

    def state_dict(self) -> dict[str, Any]:
        """Trainable weights, optimizer and scheduler on CPU (``clew.train.worker_state``).

        A sharded policy's workers must all call this; worker 0 gets the state with whole
        tensors, the others an empty dict.
        """
        return worker_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_worker_state(self, state)

    def save_pretrained(self, directory: str | Path, merged: bool = False) -> Path:
        """Save the adapter (LoRA) or the full model; ``merged`` writes LoRA merged into full weights.

        A sharded policy's workers must all call this; worker 0 writes the whole weights.
        """
        return save_policy(self, directory, merged)
