"""Supervised warm-up from expert demonstrations, before RL: the SFT loop (``clew sft``).

A policy trained from scratch starts by writing random tokens; GRPO then sees reward 0 in
every sample and has nothing to learn from. A few hundred steps of imitating the env's
expert teach the action format and the basics of moving, so RL starts where rewards vary.
The demonstrations (expert episodes with detours, starts anywhere) are
``clew.trainer.demonstrations``; DAgger rounds are ``clew.trainer.dagger``.
``clew.trainer.sft_launch.run_sft_stage`` assembles a run of this loop from the config's
``sft`` section.

One step: the step's demonstrations (played one batch ahead on a thread), a DAgger round
when one is due, the batch's DAgger share mixed in, one optimizer step, an evaluation when
due, then logging, checkpointing and exports, as in the GRPO loop.

Exact resume. ``state_dict()`` holds what a resumed run needs to take the very steps the
uninterrupted one would (the worker keeps its weights, optimizer and schedule):

* the step, the best evaluation so far and its step, the first and last evaluations, and
  the count of steps in a row whose gradient was not finite;
* nothing for the demonstrations: batch ``k`` is a pure function of ``(sft.seed, k)``
  (``DemonstrationStream``), so the step is their position, whatever the thread had
  played ahead when the process died;
* the DAgger generator's state and the pool of branch demonstrations. The pool is stored
  as the demonstrations themselves, frames as PNG (lossless; a maze frame is a few KB):
  a round plays the policy of its step, which a resumed run no longer has, so the pool
  cannot be replayed.
"""

from __future__ import annotations

import io
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from clew.checkpoint.state import Checkpointer
from clew.cluster.group import LocalWorkerGroup, WorkerGroup, play_policy
from clew.config import ClewConfig
from clew.data.rows import Row
from clew.errors import ClewError, DataError
from clew.inference.engine import EngineOptions
from clew.metrics import MetricsCollector
from clew.metrics.loggers import MultiLogger
from clew.models.chat import ChatFormat
from clew.train.optim import MAX_DROPPED_STEPS
from clew.train.worker import PolicyWorker
from clew.trainer.dagger import DaggerSettings, dagger_round, mix_in
from clew.trainer.demonstrations import Demonstration, demonstrations
from clew.trainer.stopping import GracefulStop

EvalFn = Callable[[torch.nn.Module, ChatFormat, int], dict[str, float]]
"""``eval_fn(model, chat, step)``: evaluation metrics (``eval/all/pass_at_1`` among them).
It may run in another process (a Ray worker's): it must pickle, as a module-level function
or a closure over plain data does."""

BEST_KEY = "eval/all/pass_at_1"


@dataclass
class SFTResult:
    """Where a finished SFT run left its policy, and how it evaluated."""

    run_dir: Path
    final_policy: str  # export_path/final/policy: full weights (LoRA merged) and processor
    step: int  # the step the run ended on
    last_eval: dict[str, float] = field(default_factory=dict)
    first_eval: dict[str, float] = field(default_factory=dict)
    num_demonstrations: int = 0  # training rows the expert can solve


@dataclass
class SFTLoopState:
    step: int = 0
    best_eval: float = -1.0  # the best eval/all/pass_at_1 so far (export_best)
    best_step: int = -1
    dropped: int = 0  # steps in a row whose gradient was NaN or infinite (no update)
    stopped_at_pass: bool = False  # sft.stop_at_pass was reached: the run is over
    first_eval: dict[str, float] = field(default_factory=dict)
    last_eval: dict[str, float] = field(default_factory=dict)


class DemonstrationStream:
    """Batches of expert demonstrations where batch ``k`` depends only on ``(seed, k)``.

    The rows are walked pass after pass, each pass in its own order drawn from ``(seed,
    pass)``; batch ``k`` holds rows ``k * batch_size`` to ``(k + 1) * batch_size - 1`` of
    that walk, so batches run across pass boundaries and every row is seen once a pass.
    Pass ``p`` plays its detours and starts with seed ``seed + p`` (so each pass sees new
    ones; without either every pass replays the same episodes), and a row's demonstration
    depends only on that seed and the row (``demonstrations``). Only the batch asked for is
    played: a whole dataset of played episodes (every frame an image) would not fit.
    """

    def __init__(
        self,
        rows: Sequence[Row],
        chat: ChatFormat,
        batch_size: int,
        seed: int = 0,
        detour_prob: float = 0.0,
        start_anywhere: float = 0.0,
        image_window: int | None = None,
    ) -> None:
        if not rows:
            raise DataError("no rows to play demonstrations of")
        self.rows = list(rows)
        self.chat = chat
        self.batch_size = batch_size
        self.seed = seed
        self.detour_prob = detour_prob
        self.start_anywhere = start_anywhere
        self.image_window = image_window
        self._cached_order: tuple[int, np.ndarray] | None = None

    def _order(self, pass_index: int) -> np.ndarray:
        # One random.Random(seed) shuffling the rows once a pass, walked from the end: the
        # order clew's SFT has always drawn, so a seed's run stays the run it was (the CPU
        # main job's SFT start among them). Pass p replays the shuffles before it; the
        # latest pass's order is kept.
        cached = self._cached_order
        if cached is None or cached[0] != pass_index:
            rng = random.Random(self.seed)
            for _ in range(pass_index + 1):
                order = list(range(len(self.rows)))
                rng.shuffle(order)
            cached = self._cached_order = (pass_index, np.array(order[::-1]))
        return cached[1]

    def batch(self, k: int) -> list[Demonstration]:
        n, out = len(self.rows), []
        varies = self.detour_prob > 0 or self.start_anywhere > 0
        for j in range(k * self.batch_size, (k + 1) * self.batch_size):
            p = j // n
            row = self.rows[int(self._order(p)[j % n])]
            seed = self.seed + p if varies else self.seed
            for demo in demonstrations(
                [row], self.chat, self.detour_prob, seed, start_anywhere=self.start_anywhere
            ):
                demo.image_window = self.image_window
                out.append(demo)
        return out


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _unpng(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as image:
        return image.copy()


class SFTTrainer:
    """Drives a policy (a ``PolicyWorker`` or a ``WorkerGroup``) through SFT
    steps on ``rows``' expert demonstrations.

    ``checkpointer`` (``clew.checkpoint.state.Checkpointer`` of the ``sft`` stage) saves and
    restores ``{"sft": self, "worker": policy}`` and writes the exports; ``eval_fn`` runs
    every ``sft.eval_interval`` steps and after the last; ``loggers`` get one flat dict a
    step (``clew.metrics.make_loggers``).
    """

    def __init__(
        self,
        cfg: ClewConfig,
        policy: WorkerGroup | PolicyWorker,
        rows: Sequence[Row],
        checkpointer: Checkpointer,
        loggers: MultiLogger,
        *,
        eval_fn: EvalFn | None = None,
        autocast: bool = False,
        engine: EngineOptions | None = None,
    ) -> None:
        s = cfg.sft
        self.cfg = cfg
        self.engine = engine  # what DAgger's episodes run on (clew.rollout.loop.play_model)
        self.policy = LocalWorkerGroup(policy) if isinstance(policy, PolicyWorker) else policy
        self.checkpointer = checkpointer
        self.loggers = loggers
        self.eval_fn = eval_fn
        self.autocast = autocast
        self.rows = [row for row in rows if row.solvable]
        if not self.rows:
            raise DataError(
                "no training row can be solved within its turn budget; nothing to imitate"
            )
        self.image_window = cfg.generator.keep_last_k_images
        self.stream = DemonstrationStream(
            self.rows, self.policy.chat, s.batch_size, s.seed, s.detour_prob, s.start_anywhere,
            self.image_window,
        )  # fmt: skip
        d = s.dagger
        self.dagger = (
            DaggerSettings(d.interval, d.rows, d.share, d.keep_rounds, d.temperature)
            if d.interval > 0
            else None
        )
        self.dagger_rng = random.Random(s.seed + 1)
        # Rounds of branch demonstrations, numbered, the newest last (sft.dagger.keep_rounds).
        self.rounds: deque[tuple[int, list[Demonstration]]] = deque(maxlen=d.keep_rounds or None)
        self.pool: list[Demonstration] = []
        self._encoded: dict[int, list[Demonstration]] = {}  # rounds as stored, by number
        self.state = SFTLoopState()
        self.metrics = MetricsCollector()

    # -- the loop -------------------------------------------------------------------
    def fit(self) -> SFTResult:
        """Resume if a checkpoint is there, train to ``sft.steps`` (or a stop), export."""
        self.checkpointer.maybe_resume(self.checkpointed())
        saved = self.state.step  # a resumed step is saved already
        with (
            GracefulStop("SFT") as stop,
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="clew-demos") as ahead,
        ):
            saved = self._loop(stop, ahead, saved)
        s = self.state
        final = self.checkpointer.export_final(self.write_policy)
        if s.dropped >= MAX_DROPPED_STEPS:
            raise ClewError(
                f"the gradient was NaN or infinite at SFT steps {s.step - s.dropped + 1}-"
                f"{s.step}, so none of them changed the policy; stopped, and exported the "
                f"policy of step {s.step - s.dropped} to {final}. Lower "
                "sft.optimizer_config.lr or check the data."
            )
        # However the loop ended (the last step, a stop, a signal), its step is saved.
        if self.cfg.sft.ckpt_interval > 0 and s.step > saved:
            self.checkpointer.save(s.step, self.checkpointed())
        return SFTResult(
            self.checkpointer.run_dir, final, s.step, s.last_eval, s.first_eval, len(self.rows)
        )

    def _loop(self, stop: GracefulStop, ahead: ThreadPoolExecutor, saved: int) -> int:
        s, cfg = self.state, self.cfg.sft
        max_seconds = None if cfg.max_minutes is None else 60 * cfg.max_minutes
        started = time.monotonic()
        pending: Future | None = None
        if s.step < cfg.steps and not s.stopped_at_pass:
            pending = ahead.submit(self.stream.batch, s.step)
        while pending is not None:
            batch = pending.result()
            s.step += 1
            step = s.step
            pending = ahead.submit(self.stream.batch, step) if step < cfg.steps else None
            with self.metrics.timer("step"):
                self.dagger_round(step)
                self.train(self.mix(batch))
                elapsed = time.monotonic() - started
                self.metrics.add("sft/elapsed_s", elapsed, reduce="last")
                last = (
                    step == cfg.steps
                    or (max_seconds is not None and elapsed >= max_seconds)
                    or stop.requested  # SIGINT/SIGTERM: evaluated and saved as the last step
                )
                if self.eval_fn is not None and (self._due(cfg.eval_interval, step) or last):
                    last = self.evaluate(step) or last
            self.loggers.log(self.metrics.flush(step), step)
            if last or s.dropped >= MAX_DROPPED_STEPS:
                break
            if self._due(cfg.ckpt_interval, step):
                self.checkpointer.save(step, self.checkpointed())
                saved = step
            if self._due(cfg.hf_save_interval, step):
                self.checkpointer.export(self.write_policy, step)
        if stop.requested:
            print(f"stopped by {stop.signal_name} after SFT step {s.step}", flush=True)
        return saved

    # -- the phases -----------------------------------------------------------------
    def dagger_round(self, step: int) -> None:
        """When due (every ``sft.dagger.interval`` steps), the policy plays training rows and
        their branch demonstrations join the pool."""
        d = self.dagger
        if d is None or step == 1 or (step - 1) % d.interval:
            return
        with self.metrics.timer("dagger"):
            demos, stats = dagger_round(
                self._play, self.policy.chat, self.rows, d, self.dagger_rng,
                image_window=self.image_window,
            )  # fmt: skip
        number = self.rounds[-1][0] + 1 if self.rounds else 1
        self.rounds.append((number, demos))
        self._pool_changed()
        self.metrics.add_many(stats | {"sft/dagger_pool": float(len(self.pool))})

    def mix(self, batch: list[Demonstration]) -> list[Demonstration]:
        """The batch with its DAgger share drawn from the pool (when DAgger is on)."""
        if self.dagger is None:
            return batch
        return mix_in(batch, self.pool, self.dagger.share, self.dagger_rng)

    def train(self, batch: list[Demonstration]) -> None:
        with self.metrics.timer("update"):
            stats = self.policy.sft_step(batch, self.cfg.sft.micro_batch_size or len(batch))
        self.state.dropped = self.state.dropped + 1 if stats["sft/skipped"] else 0
        self.metrics.add_many(stats)

    def evaluate(self, step: int) -> bool:
        """Evaluate, keep the best; True when ``sft.stop_at_pass`` is reached."""
        assert self.eval_fn is not None
        with self.metrics.timer("evaluate"):
            metrics = self.policy.with_policy(self.eval_fn, step)
        self.metrics.add_many(metrics)
        s, target = self.state, self.cfg.sft.stop_at_pass
        s.last_eval = dict(metrics)
        s.first_eval = s.first_eval or dict(metrics)
        value = metrics.get(BEST_KEY)
        if value is not None and value > s.best_eval:  # ties keep the earlier step
            s.best_eval, s.best_step = value, step
            if self.cfg.sft.export_best:
                with self.metrics.timer("export"):
                    self.checkpointer.export_best(self.write_policy, step, value)
        s.stopped_at_pass = target is not None and (value or 0.0) >= target
        return s.stopped_at_pass

    def write_policy(self, directory: Path) -> None:
        """A loadable policy directory: full weights (LoRA merged in) and the processor."""
        self.policy.write_policy(directory)

    def _play(self, rows: Sequence[Row], settings: Any, seed: int) -> list[Any]:
        return self.policy.with_policy(
            play_policy, rows, settings, seed, self.autocast, self.engine
        )

    # -- state ----------------------------------------------------------------------
    def checkpointed(self) -> dict[str, Any]:
        """What a checkpoint saves and a resume restores, by name."""
        return {"sft": self, "worker": self.policy}

    def state_dict(self) -> dict[str, Any]:
        for number, demos in self.rounds:
            if number not in self._encoded:  # each round is encoded once
                self._encoded[number] = [
                    replace(d, images=[_png(im) for im in d.images]) for d in demos
                ]
        return {
            "loop": dict(vars(self.state)),
            "dagger_rng": self.dagger_rng.getstate(),
            "rounds": [(n, self._encoded[n]) for n, _ in self.rounds],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = SFTLoopState(**state["loop"])
        self.dagger_rng.setstate(state["dagger_rng"])
        self.rounds.clear()
        self._encoded = dict(state["rounds"])
        for number, demos in state["rounds"]:
            self.rounds.append(
                (number, [replace(d, images=[_unpng(b) for b in d.images]) for d in demos])
            )
        self._pool_changed()

    def _pool_changed(self) -> None:
        # Flattened once a round, not on every step that draws from it.
        self.pool = [d for _, demos in self.rounds for d in demos]
        kept = {n for n, _ in self.rounds}
        self._encoded = {n: v for n, v in self._encoded.items() if n in kept}

    @staticmethod
    def _due(interval: int, step: int) -> bool:
        return interval > 0 and step % interval == 0
