"""Supervised warm-up from solver demonstrations, before RL.

A policy trained from scratch starts by writing random tokens; GRPO then sees reward 0 in
every sample and has nothing to learn from. A few hundred steps of imitating the BFS
solver teach the action format and the basics of moving, so RL starts where rewards vary.
The demonstrations (solver episodes with detours, starts anywhere, and their batches) are
``clew.train.demonstrations``; DAgger rounds are ``clew.train.dagger``.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from clew.data.rows import Row
from clew.errors import ClewError, ConfigError, DataError
from clew.models.chat import ChatFormat
from clew.stopping import GracefulStop
from clew.train.dagger import BranchPool, DaggerSettings, dagger_round, mix_in
from clew.train.demonstrations import check_shares, demonstration_batches
from clew.train.optim import MAX_DROPPED_STEPS
from clew.train.worker import PolicyWorker, WorkerSettings

EvalFn = Callable[[torch.nn.Module, ChatFormat, int], dict[str, float]]
LogFn = Callable[[int, dict[str, float]], None]


@dataclass
class SFTResult:
    """Where the model went and how training went."""

    output_dir: Path
    losses: list[float]
    evals: list[dict[str, float]]
    num_demonstrations: int


def _save(worker: PolicyWorker, directory: Path) -> None:
    """A loadable policy directory: full weights (LoRA merged in) and the processor."""
    worker.save_pretrained(directory, merged=True)
    worker.chat.processor.save_pretrained(directory)


def _save_best(worker: PolicyWorker, directory: Path, step: int, value: float) -> None:
    """The policy as ``directory/policy`` and ``best.json`` (step, pass@1) beside it, as
    ``clew train``'s ``export_best``: the old best goes first and best.json is written last,
    so a best.json on disk always describes the policy beside it."""
    if directory.exists():
        shutil.rmtree(directory)
    _save(worker, directory / "policy")
    record = {"step": step, "eval/all/pass_at_1": value}
    (directory / "best.json").write_text(json.dumps(record, indent=2))


def run_sft(
    model_dir: str | Path,
    train_rows: Sequence[Row],
    output_dir: str | Path,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    lora_rank: int = 0,
    lora_alpha: float = 16.0,
    lora_dropout: float = 0.0,
    lora_target_modules: str | list[str] = "all-linear",
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    warmup_steps: int = 0,
    scheduler: str = "constant_with_warmup",
    micro_batch_size: int | None = None,
    pack_sequences: bool = False,
    detour_prob: float = 0.0,
    start_anywhere: float = 0.0,
    keep_last_k_images: int | None = None,
    max_seconds: float | None = None,
    stop_at_pass: float | None = None,
    seed: int = 0,
    dtype: str = "float32",
    autocast_bf16: bool = False,
    device: str = "cpu",
    eval_fn: EvalFn | None = None,
    eval_interval: int = 0,
    save_interval: int = 0,
    save_best: bool = False,
    dagger: DaggerSettings | None = None,
    log: LogFn | None = None,
) -> SFTResult:
    """Train on solver demonstrations of ``train_rows`` and save a loadable policy directory.

    Each step is one optimizer step on ``batch_size`` whole episodes drawn without
    replacement (reshuffled each pass; with detours, each pass plays new detours), played
    one batch ahead on a thread (``demonstration_batches``).
    ``eval_fn(model, chat, step)`` runs every ``eval_interval`` steps and after the last.
    ``output_dir`` gets full weights (LoRA merged in) and the processor, so
    ``clew.models.load_policy`` reads it like any checkpoint. ``keep_last_k_images``
    trains with the image window the policy will be run with (generator.keep_last_k_images).
    ``max_seconds`` ends training (evaluated and saved as after the last step) at the first
    step that finishes past that wall-clock budget; so does a SIGINT or SIGTERM
    (``clew.stopping``) at the step it arrives in. ``stop_at_pass`` ends it (saved) at the
    first evaluation whose ``eval/all/pass_at_1`` reaches it: an SFT start meant to lie in a
    band of solve rates stops in it rather than past it. ``dtype`` and ``autocast_bf16`` are the
    weights' dtype and bfloat16 compute (``clew.models.precision``); ``pack_sequences``
    lays the batch's episodes end to end in rows, ``micro_batch_size`` rows a forward
    (``clew.train.batch.collate``: the same loss with less padding). ``save_interval`` also
    saves the policy every that many steps to ``output_dir/step_N`` (as HF's ``save_steps``),
    so a start of a chosen strength can be taken from along the curve. ``save_best`` keeps the
    policy of the best evaluation so far (``eval/all/pass_at_1``, ties keep the earlier step) in
    ``output_dir/best/policy`` with ``best.json`` naming its step: the SFT curve is noisy, and
    its peak is often not its last step. ``dagger`` adds DAgger
    rounds: every ``dagger.interval`` steps the policy plays training rows and its branch
    demonstrations (those of the latest ``dagger.keep_rounds`` rounds) fill ``dagger.share``
    of each batch until the next round
    (``clew.train.dagger``).
    """
    if steps < 1 or batch_size < 1:
        raise ConfigError(f"steps and batch_size must be positive, got {steps} and {batch_size}")
    if not lr > 0:
        raise ConfigError(f"lr must be > 0, got {lr}")
    if lora_rank < 0:
        raise ConfigError(f"lora_rank must be >= 0 (0 trains all weights), got {lora_rank}")
    if lora_rank > 0 and not lora_alpha > 0:
        raise ConfigError(f"lora_alpha must be > 0, got {lora_alpha}")
    if warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be >= 0, got {warmup_steps}")
    output_dir = Path(output_dir)
    if output_dir.resolve() == Path(model_dir).resolve():
        raise ConfigError(f"output_dir {output_dir} is the starting model; choose another folder")
    if keep_last_k_images is not None and keep_last_k_images < 1:
        raise ConfigError(f"keep_last_k_images must be >= 1 or None, got {keep_last_k_images}")
    check_shares(detour_prob, start_anywhere)
    if stop_at_pass is not None and not 0.0 < stop_at_pass <= 1.0:
        raise ConfigError(f"stop_at_pass is a solve rate in (0, 1], got {stop_at_pass}")
    if save_interval < 0:
        raise ConfigError(
            f"save_interval is a number of steps >= 0 (0: never), got {save_interval}"
        )
    if stop_at_pass is not None and eval_fn is None:
        raise ConfigError("stop_at_pass needs an evaluation: give eval data (--eval-data)")
    if save_best and eval_fn is None:
        raise ConfigError(
            "save_best (--save-best) keeps the best evaluation: give eval data (--eval-data)"
        )
    torch.manual_seed(seed)
    settings = WorkerSettings(
        lr=lr,
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        scheduler=scheduler,
        num_warmup_steps=warmup_steps,
        num_training_steps=steps,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        lora_target_modules=lora_target_modules,
        autocast_bf16=autocast_bf16,
        pack_sequences=pack_sequences,
    )
    worker = PolicyWorker.from_pretrained(model_dir, settings, dtype=dtype, device=device)
    chat = worker.chat

    solvable = [row for row in train_rows if row.solvable]
    if not solvable:
        raise DataError("no training row can be solved within its turn budget; nothing to imitate")
    batches = demonstration_batches(
        solvable, chat, batch_size, detour_prob, seed, keep_last_k_images, start_anywhere
    )
    losses: list[float] = []
    evals: list[dict[str, float]] = []
    branches = BranchPool(dagger.keep_rounds if dagger is not None else 1)
    dagger_rng = random.Random(seed + 1)
    best = -1.0  # the best eval/all/pass_at_1 so far (save_best)
    dropped = 0  # steps in a row whose gradient was NaN or infinite (no update)
    started = time.monotonic()
    # One batch is played ahead on a thread while the current one trains.
    with (
        GracefulStop("SFT") as stop,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="clew-demos") as pool,
    ):
        ahead = pool.submit(next, batches)
        for step in range(1, steps + 1):
            batch = ahead.result()
            if step < steps:
                ahead = pool.submit(next, batches)
            round_stats: dict[str, float] = {}
            if dagger is not None and step > 1 and (step - 1) % dagger.interval == 0:
                round_demos, round_stats = dagger_round(
                    worker.model, chat, solvable, dagger, dagger_rng,
                    image_window=keep_last_k_images, autocast=autocast_bf16,
                )  # fmt: skip
                branches.add(round_demos)
                round_stats["sft/dagger_pool"] = float(len(branches.demos))
            if dagger is not None:
                batch = mix_in(batch, branches.demos, dagger.share, dagger_rng)
            stats = worker.sft_step(batch, micro_batch_size or batch_size) | round_stats
            dropped = dropped + 1 if stats["sft/skipped"] else 0
            losses.append(stats["sft/loss"])
            elapsed = time.monotonic() - started
            last = (
                step == steps
                or (max_seconds is not None and elapsed >= max_seconds)
                or stop.requested  # SIGINT/SIGTERM: evaluated and saved as the last step
            )
            stats["sft/elapsed_s"] = elapsed
            if eval_fn is not None and ((eval_interval and step % eval_interval == 0) or last):
                metrics = eval_fn(worker.model, chat, step)
                evals.append(metrics)
                stats = stats | metrics
                value = metrics.get("eval/all/pass_at_1")
                if save_best and value is not None and value > best:
                    best = value
                    _save_best(worker, output_dir / "best", step, value)
                if stop_at_pass is not None:
                    last = last or (value or 0.0) >= stop_at_pass
            if log is not None:
                log(step, stats)
            if save_interval and step % save_interval == 0 and not last:
                _save(worker, output_dir / f"step_{step}")
            if last or dropped >= MAX_DROPPED_STEPS:
                break
    _save(worker, output_dir)
    if dropped >= MAX_DROPPED_STEPS:
        raise ClewError(
            f"the gradient was NaN or infinite at SFT steps {step - dropped + 1}-{step}, so "
            f"none of them changed the policy; stopped, and saved the policy of step "
            f"{step - dropped} to {output_dir}. Lower --lr or check the data."
        )
    return SFTResult(output_dir, losses, evals, len(solvable))
