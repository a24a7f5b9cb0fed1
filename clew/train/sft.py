"""Supervised warm-up from solver demonstrations, before RL.

A policy trained from scratch starts by writing random tokens; GRPO then sees reward 0 in
every sample and has nothing to learn from. A few hundred steps of imitating the BFS
solver teach the action format and the basics of moving, so RL starts where rewards vary.

Demonstrations are played in the real env and tokenized through ``ChatFormat`` exactly as
the rollout engine builds an episode (first turn ``first=True``, later turns after a reply
that ended with ``<|im_end|>``), so SFT trains on the very sequences the policy will later
extend. With ``detour_prob`` > 0 some turns take a wrong move on purpose (an open cell off
the shortest path, or a bump into a wall) and the solver recovers from there, as VisGym
pads its demonstrations: the policy then sees states off the optimal path and how to come
back from them. Detour replies are in the context but out of the loss by default
(``train_on_detours``), so the policy learns to recover without learning to stray. With
``start_anywhere`` > 0 that share of demonstrations starts on a random open cell (one
the budget still reaches the goal from) instead of the maze's start: the solver's move from
every part of the maze, as the planning probes learn it (BENCHMARKS.md, "Tenth attempt").
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clew.data.rows import MazeRow
from clew.envs import make
from clew.envs.maze.actions import Action, format_action
from clew.envs.maze.generate import DIRECTIONS
from clew.envs.maze.solver import distances_to, shortest_actions
from clew.errors import ClewError, ConfigError, DataError
from clew.models.chat import ChatFormat
from clew.stopping import GracefulStop
from clew.train.batch import Sample
from clew.train.dagger import BranchPool, DaggerSettings, dagger_round, mix_in
from clew.train.optim import MAX_DROPPED_STEPS
from clew.train.worker import PolicyWorker, WorkerSettings

EvalFn = Callable[[torch.nn.Module, ChatFormat, int], dict[str, float]]
LogFn = Callable[[int, dict[str, float]], None]


@dataclass
class Demonstration(Sample):
    """One solver episode as a training sequence, with what was played."""

    actions: list[str] = field(default_factory=list)
    # 0-based turns out of the solver's path: detours, and a DAgger branch's policy turns
    detour_turns: list[int] = field(default_factory=list)
    reward: float = 0.0
    row_seed: int = 0
    # Where each observation chunk begins, and the image window the policy will run with
    # (generator.keep_last_k_images): the batch hides older images exactly as the engine does.
    chunk_starts: list[int] = field(default_factory=list)
    image_window: int | None = None


def _next_action(
    env: Any, dist: np.ndarray, rng: random.Random, detour_prob: float
) -> tuple[Action, bool]:
    """The solver's action, or with probability ``detour_prob`` an affordable wrong one."""
    maze, agent = env.maze, env.agent
    stop_cost = 0 if env.success_on_reach else 1
    if agent == maze.goal and not env.success_on_reach:
        best = Action("stop")
    else:
        # Where several moves are optimal (open rooms), pick one at random: a fixed
        # tie-break makes long runs of one action, and a policy imitating them learns to
        # repeat its last move instead of reading the picture.
        optimal = [
            d
            for d, (dr, dc) in enumerate(DIRECTIONS)
            if maze.is_open((agent[0] + dr, agent[1] + dc))
            and dist[agent[0] + dr, agent[1] + dc] == dist[agent] - 1
        ]
        best = Action(
            "move", rng.choice(optimal) if optimal else shortest_actions(maze, start=agent)[0]
        )
    if detour_prob <= 0 or rng.random() >= detour_prob:
        return best, False
    remaining = env.max_turns - env.turn
    choices = []
    for d, (dr, dc) in enumerate(DIRECTIONS):
        target = (agent[0] + dr, agent[1] + dc)
        # A detour leads away from the goal (or bumps a wall and stays): never a move that
        # is itself on a shortest path.
        if maze.is_open(target):
            if dist[target] < dist[agent]:
                continue
            needed_after = int(dist[target]) + stop_cost
        else:
            needed_after = int(dist[agent]) + stop_cost
        # The wrong turn uses one turn; the solver must still finish inside the budget.
        if remaining - 1 >= needed_after:
            choices.append(d)
    if not choices:
        return best, False
    return Action("move", rng.choice(choices)), True


def play_demonstration(
    row: MazeRow,
    chat: ChatFormat,
    rng: random.Random,
    detour_prob: float = 0.0,
    train_on_detours: bool = False,
    start_anywhere: float = 0.0,
    prefix: Sequence[str] = (),
) -> Demonstration | None:
    """Play ``row`` with the solver; None if the optimal play does not fit its turn budget.

    ``prefix``: replies played first, as given and out of the loss (the policy's own turns
    of a DAgger branch, ``clew.train.dagger``); the solver plays on from where they lead.
    """
    env = make(row.env_id, **row.options())
    obs = env.reset(int(row.seed))
    if env.turns_needed() > env.max_turns:
        return None
    dist = distances_to(env.maze, env.maze.goal)
    if start_anywhere > 0 and not prefix and rng.random() < start_anywhere:
        obs = env.reset(int(row.seed), start=rng.choice(env.start_cells()))
    demo = Demonstration([], [], [], row_seed=int(row.seed))
    turn = 0
    while True:
        chunk = chat.user_turn(
            obs.text, obs.images, first=turn == 0, after_reply_end=True, pixels=False
        )
        demo.chunk_starts.append(len(demo.token_ids))
        demo.token_ids += chunk.token_ids
        demo.loss_mask += [0] * len(chunk.token_ids)
        demo.images += obs.images
        if turn < len(prefix):
            text, detour = prefix[turn], True
        else:
            action, detour = _next_action(env, dist, rng, detour_prob)
            text = format_action(action, env.action_format)
        reply = chat.reply_tokens(text)
        demo.token_ids += reply
        in_loss = not detour or (train_on_detours and turn >= len(prefix))
        demo.loss_mask += [int(in_loss)] * len(reply)
        demo.actions.append(text)
        if detour:
            demo.detour_turns.append(turn)
        obs, reward, done, _ = env.step(text)
        demo.reward = float(reward)
        turn += 1
        if done:
            return demo


def demonstrations(
    rows: Sequence[MazeRow],
    chat: ChatFormat,
    detour_prob: float = 0.0,
    seed: int = 0,
    train_on_detours: bool = False,
    start_anywhere: float = 0.0,
) -> list[Demonstration]:
    """Solver episodes for ``rows`` (rows whose optimal play exceeds max_turns are skipped).

    Each row's detours and start depend only on ``seed`` and the row's seed, not on the
    row order.
    """
    _check_shares(detour_prob, start_anywhere)
    out = []
    for row in rows:
        rng = random.Random(seed * 1_000_003 + int(row.seed))
        demo = play_demonstration(row, chat, rng, detour_prob, train_on_detours, start_anywhere)
        if demo is not None:
            out.append(demo)
    return out


def _check_shares(detour_prob: float, start_anywhere: float) -> None:
    for name, value in (("detour_prob", detour_prob), ("start_anywhere", start_anywhere)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name} is a share in [0, 1], got {value}")


def demonstration_batches(
    rows: Sequence[MazeRow],
    chat: ChatFormat,
    batch_size: int,
    detour_prob: float = 0.0,
    seed: int = 0,
    image_window: int | None = None,
    start_anywhere: float = 0.0,
) -> Iterator[list[Demonstration]]:
    """Endless batches of ``batch_size`` demonstrations of ``rows``, played when asked for.

    Rows are drawn without replacement, reshuffled each pass (``random.Random(seed)``).
    Pass ``p`` (from 1) plays its detours and starts with seed ``seed + p - 1``, so each
    pass sees new ones; without either every pass replays the first pass's episodes. A batch is
    exactly what ``demonstrations(rows, chat, detour_prob, pass seed, start_anywhere=...)``
    holds for its rows,
    but only one batch lives in memory at a time: a whole dataset of played episodes
    (every frame as an image) would not fit for large datasets. A row whose optimal play
    does not fit its turn budget is skipped.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    if not rows:
        raise DataError("no rows to play demonstrations of")
    _check_shares(detour_prob, start_anywhere)
    return _batches(list(rows), chat, batch_size, detour_prob, seed, image_window, start_anywhere)


def _batches(
    rows: list[MazeRow],
    chat: ChatFormat,
    batch_size: int,
    detour_prob: float,
    seed: int,
    image_window: int | None,
    start_anywhere: float,
) -> Iterator[list[Demonstration]]:
    rng = random.Random(seed)
    queue: list[MazeRow] = []
    passes = played = 0
    while True:
        batch: list[Demonstration] = []
        while len(batch) < batch_size:
            if not queue:
                if passes and not played:
                    raise DataError(
                        "no training row can be solved within its turn budget; nothing to imitate"
                    )
                queue = list(rows)
                rng.shuffle(queue)
                passes += 1
                played = 0
            pass_seed = seed + passes - 1 if detour_prob > 0 or start_anywhere > 0 else seed
            row = [queue.pop()]
            for demo in demonstrations(
                row, chat, detour_prob, pass_seed, start_anywhere=start_anywhere
            ):
                demo.image_window = image_window
                batch.append(demo)
                played += 1
        yield batch


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


def run_sft(
    model_dir: str | Path,
    train_rows: Sequence[MazeRow],
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
    weights' dtype and bfloat16 compute (``clew.models.precision``). ``save_interval`` also
    saves the policy every that many steps to ``output_dir/step_N`` (as HF's ``save_steps``),
    so a start of a chosen strength can be taken from along the curve. ``dagger`` adds DAgger
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
    _check_shares(detour_prob, start_anywhere)
    if stop_at_pass is not None and not 0.0 < stop_at_pass <= 1.0:
        raise ConfigError(f"stop_at_pass is a solve rate in (0, 1], got {stop_at_pass}")
    if save_interval < 0:
        raise ConfigError(
            f"save_interval is a number of steps >= 0 (0: never), got {save_interval}"
        )
    if stop_at_pass is not None and eval_fn is None:
        raise ConfigError("stop_at_pass needs an evaluation: give eval data (--eval-data)")
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
                if stop_at_pass is not None:
                    last = last or metrics.get("eval/all/pass_at_1", 0.0) >= stop_at_pass
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
