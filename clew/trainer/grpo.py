"""The GRPO loop: generate, score, advantages, update, evaluate, checkpoint, log.

One step: the sampler hands out ``train_batch_size`` maze rows; the worker group plays each
``n_samples_per_prompt`` times; rewards become group-relative advantages; the policy takes
PPO-clipped updates on the generated tokens; every ``eval_interval`` steps the fixed eval
mazes are played greedily, with the selection mazes (``data.select_data``) in the same
rollout, whose pass@1 then picks the best policy (``clew.trainer.selection``); every
``ckpt_interval`` steps the full state is saved. Metrics go to a collector and from there
to the loggers; timings are per phase. There is no weight sync phase: the engine samples
from the very modules the optimizer steps (colocated, on every worker of a group), so
nothing is copied between update and generate.

Two settings may change from step to step, the rollouts' temperature and the entropy
bonus's weight: ``clew.trainer.step_settings``.

A phase whose every episode ended as ``env_error`` (the env raised: an id a worker does not
know, a simulator that is down) stops the run with that error: there is nothing to learn
from, and going on would train on nothing and log zeros. Each export prints where it went.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from clew.algorithms import EstimatorBatch, compute_advantages, get_estimator
from clew.checkpoint.state import Checkpointer
from clew.cluster.group import WorkerGroup
from clew.config import ClewConfig
from clew.config.settings import ppo_settings, rollout_settings, training_steps
from clew.data.rows import Row
from clew.data.sampler import ResumableSampler
from clew.errors import ClewError
from clew.metrics import MetricsCollector
from clew.metrics.catalog import peak_memory_metric
from clew.metrics.loggers import MultiLogger
from clew.metrics.progress import Progress
from clew.rollout.episode_stats import rollout_metrics, stop_if_all_env_errors
from clew.rollout.evaluation import dump_eval, eval_metrics
from clew.rollout.filtering import (
    batches_needed,
    learning_rewards,
    spread_groups,
    spread_per_batch,
    take_groups,
)
from clew.rollout.loop import RolloutSettings
from clew.rollout.trajectory import Trajectory
from clew.train.optim import MAX_DROPPED_STEPS
from clew.train.training_batch import TrainingBatch
from clew.trainer.grpo_state import LoopState
from clew.trainer.selection import (
    EVAL_METRIC,
    beats_best,
    picking_metric,
    select_metrics,
    split_evaluation,
)
from clew.trainer.step_settings import StepSettings
from clew.trainer.stopping import GracefulStop

# How each piece of per-turn data an estimator may need (EstimatorSpec.needs) is read
# from a trajectory.
_ROLLOUT_DATA: dict[str, Callable[[Trajectory], Any]] = {
    "turn_rewards": lambda t: torch.tensor(t.padded_turn_rewards()),
    "state_keys": lambda t: t.state_keys,
}


class GRPOTrainer:
    """Drives a worker group through GRPO steps; checkpointing is delegated to ``checkpointer``."""

    def __init__(
        self,
        cfg: ClewConfig,
        group: WorkerGroup,
        train_rows: Sequence[Row],
        eval_rows: Sequence[Row],
        loggers: MultiLogger,
        run_dir: Path,
        checkpointer: Checkpointer | None = None,
        select_rows: Sequence[Row] = (),
    ) -> None:
        self.cfg = cfg
        self.group = group
        self.eval_rows = list(eval_rows)
        # Played with the eval rows at each evaluation; their pass@1 picks the best policy.
        self.select_rows = list(select_rows)
        self.best_metric = picking_metric(bool(self.select_rows))
        self.sampler = ResumableSampler(
            train_rows, cfg.trainer.train_batch_size, cfg.trainer.seed, cfg.trainer.epochs
        )
        self.loggers = loggers
        self.run_dir = run_dir
        self.checkpointer = checkpointer
        alg = cfg.trainer.algorithm
        self.state = LoopState(
            entropy_coef=alg.entropy_loss_coef if alg.use_entropy_loss else 0.0,
            best_metric=self.best_metric,
        )
        self.restarts = 0  # worker-group restarts so far (clew.trainer.launch.run_grpo sets it)
        self._saved_step = 0
        self._exported_step = -1  # the step of the latest global_step_N export
        self._dropped_updates = 0  # training steps in a row whose every optimizer step was dropped
        self.metrics = MetricsCollector()
        self.train_settings = rollout_settings(cfg, evaluation=False)
        self.eval_settings = rollout_settings(cfg, evaluation=True)
        self.ppo_settings = ppo_settings(cfg)
        self.schedule = StepSettings(
            cfg, training_steps(cfg, len(train_rows)), self.train_settings, self.ppo_settings
        )
        # Progress lines for long rollouts go with the console logger's lines.
        self.show_progress = "console" in cfg.trainer.logger_names

    # -- the loop -------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        if self.checkpointer is not None:
            self.checkpointer.maybe_resume(self.checkpointed())
        with GracefulStop("training") as stop:
            last_eval = self._loop(stop)
            if self.checkpointer is not None:
                # However the loop ended (max_steps, the data, a SIGINT/SIGTERM), the step
                # it reached is saved, so resume_mode=latest goes on from it, and exported.
                saved = self.state.global_step <= self._saved_step
                if self.cfg.trainer.ckpt_interval > 0 and not saved:
                    self.checkpointer.save(self.state.global_step, self.checkpointed())
                if self._exported_step != self.state.global_step:  # else written just now
                    self.export(self.state.global_step)
        return last_eval

    def _loop(self, stop: GracefulStop) -> dict[str, float]:
        t = self.cfg.trainer
        last_eval: dict[str, float] = {}
        if t.eval_before_train and self.state.global_step == 0 and self.eval_rows:
            last_eval = self.evaluate()
            self.keep_best(last_eval)
            self.loggers.log(self.metrics.flush(0), 0)
        batches = iter(self.sampler)
        self._saved_step = self.state.global_step  # a resumed step is saved already
        evaluated = self.state.global_step
        while not stop.requested and not 0 <= t.max_steps <= self.state.global_step:
            rows = next(batches, None)
            if rows is None:  # every epoch done
                break
            self.state.global_step += 1
            step = self.state.global_step
            started = time.perf_counter()
            with self.metrics.timer("step"):
                trajs, played = self.generate(rows, step, batches)
                rewards = self.score(trajs, played)
                advantages = self.advantages(trajs, rewards)
                self.update(trajs, advantages)
                if self._due(t.eval_interval, step) and self.eval_rows:
                    last_eval, evaluated = self.evaluate(), step
                    self.keep_best(last_eval)
            self.throughput(played, time.perf_counter() - started)
            # Logged before the checkpoint, so a checkpoint of step N holds step N's metrics
            # and a run killed right after it resumes with its history complete. The save's
            # own time is therefore reported with the next step.
            self.log(step)
            if self._due(t.ckpt_interval, step) and self.checkpointer is not None:
                with self.metrics.timer("checkpoint"):
                    self.checkpointer.save(step, self.checkpointed())
                self._saved_step = step
            if self._due(t.hf_save_interval, step) and self.checkpointer is not None:
                with self.metrics.timer("export"):
                    self.export(step)
        if stop.requested:
            print(f"stopped by {stop.signal_name} after step {self.state.global_step}", flush=True)
        elif t.eval_interval > 0 and self.eval_rows and evaluated < self.state.global_step:
            # The run ended (max_steps or the data) between evaluations: the final policy is
            # evaluated too, logged at its step. A signal stops at once instead.
            last_eval = self.evaluate()
            self.keep_best(last_eval)
            self.loggers.log(self.metrics.flush(self.state.global_step), self.state.global_step)
        return last_eval

    # -- the phases -----------------------------------------------------------------
    def generate(
        self, rows: Sequence[Row], step: int, more: Iterator[list[Row]] | None = None
    ) -> tuple[list, list]:
        """The step's trajectories to learn from, and every trajectory played for them.

        They are the same unless dynamic sampling filters: then batches are drawn from
        ``more`` (the sampler, so a resumed run goes on after them) until enough groups
        have reward spread (``clew.rollout.filtering``). The first play takes as many
        batches at once as the last step needed.
        """
        ds = self.cfg.trainer.algorithm.dynamic_sampling
        want, limit = self.cfg.trainer.train_batch_size, ds.max_sample_batches
        discount = self.cfg.trainer.algorithm.turn_discount
        more = more if more is not None else iter(())
        settings = self.schedule.rollout(step)
        self.metrics.add("train/temperature", settings.sampling.temperature)
        with self.metrics.timer("generate"):
            if ds.type != "filter":
                played = self._play(rows, settings, self._seed(step), "generate")
                return played, played

            def draw() -> list[Row] | None:  # the next batch, unless the limit or data is out
                return None if 0 < limit <= drawn else next(more, None)

            first, drawn = list(rows), 1
            while drawn < self.state.sample_batches and (extra := draw()) is not None:
                first, drawn = first + list(extra), drawn + 1
            played = self._play(first, settings, self._seed(step), "generate")
            groups = spread_groups(played, discount)
            counts = spread_per_batch(groups, drawn, len(rows))
            while len(groups) < want and (extra := draw()) is not None:
                seed = self._seed(step) + 1_000_000_007 * drawn
                batch = self._play(extra, settings, seed, "generate", f"batch {drawn + 1}")
                found = spread_groups(batch, discount)
                played, groups, drawn = played + batch, groups + found, drawn + 1
                counts.append(len(found))
            self.state.sample_batches = batches_needed(counts, want)
        self.metrics.add_many(
            {
                "train/dynamic_sampling/batches": float(drawn),
                "train/dynamic_sampling/kept_groups": float(min(len(groups), want)),
            }
        )
        return take_groups(groups, want), played

    def score(self, trajs: Sequence, played: Sequence) -> torch.Tensor:
        """Rewards of ``trajs`` (what the update learns from, after ``turn_discount``);
        rollout metrics of ``played`` (the env's rewards)."""
        with self.metrics.timer("score"):
            self.metrics.add_many(rollout_metrics(played, "train"))
            return learning_rewards(trajs, self.cfg.trainer.algorithm.turn_discount)

    def advantages(
        self, trajs: Sequence, rewards: torch.Tensor
    ) -> torch.Tensor | list[torch.Tensor]:
        """One advantage per trajectory, or per turn (``Float[T_i]`` each) from estimators
        that assign credit within an episode. The estimator's spec says which per-turn data
        to hand it (``_ROLLOUT_DATA``); its settings are the ``trainer.algorithm`` section."""
        a = self.cfg.trainer.algorithm
        with self.metrics.timer("advantages"):
            if not trajs:  # dynamic sampling found no group with signal: nothing to learn
                return torch.zeros(0)
            needs = get_estimator(a.advantage_estimator).needs
            batch = EstimatorBatch(
                rewards,
                torch.tensor([t.group_id for t in trajs]),
                **{need: [_ROLLOUT_DATA[need](t) for t in trajs] for need in needs},
            )
            result = compute_advantages(a.advantage_estimator, batch, a.model_dump())
            adv = result.advantages * result.keep.float()
            self.metrics.add_many({f"train/{k}": v for k, v in result.stats.items()})
            if result.turn_advantages is not None:
                turns = [
                    ta * k.float()
                    for ta, k in zip(result.turn_advantages, result.keep, strict=True)
                ]
                flat = torch.cat(turns) if turns else torch.zeros(0)
                self.metrics.add(
                    "train/turn_advantage_std", flat.std().item() if len(flat) > 1 else 0.0
                )
            self.metrics.add_many(
                {
                    "train/advantage_mean": adv.mean().item(),
                    "train/advantage_std": adv.std().item() if len(adv) > 1 else 0.0,
                    "train/advantage_abs_max": adv.abs().max().item(),
                    "train/zero_spread_groups": float(result.zero_spread_groups),
                    "train/zero_spread_fraction": result.zero_spread_groups
                    / max(result.num_groups, 1),
                }
            )
            return adv if result.turn_advantages is None else turns

    def update(self, trajs: Sequence, advantages: torch.Tensor | list[torch.Tensor]) -> None:
        if not trajs:
            return
        settings = self.schedule.update(self.state.global_step, self.state)
        with self.metrics.timer("update"), self._peak_memory("update"):
            batch = TrainingBatch.from_trajectories(trajs, advantages)
            stats = self.group.update(batch, settings)
        self.metrics.add_many(stats)
        if self.cfg.trainer.algorithm.use_entropy_loss:
            self.metrics.add("policy/entropy_coef", settings.entropy_loss_coef)
        self.schedule.adapt_entropy_coef(self.state, stats)
        steps, dropped = (
            stats.get("policy/optimizer_steps", 0),
            stats.get("policy/skipped_steps", 0),
        )
        self._dropped_updates = self._dropped_updates + 1 if steps and dropped == steps else 0
        if self._dropped_updates >= MAX_DROPPED_STEPS:
            step = self.state.global_step
            raise ClewError(
                f"the gradient was NaN or infinite at every optimizer step of training steps "
                f"{step - MAX_DROPPED_STEPS + 1}-{step}, so none of them changed the policy; "
                "stopping. Check the loss settings (trainer.algorithm.entropy_loss_coef, "
                "kl_loss_coef, trainer.policy.optimizer_config.lr); the checkpoints and "
                "exports already written are kept."
            )

    def evaluate(self) -> dict[str, float]:
        """The eval rows' metrics (``eval/...``) and the selection rows' (``select/...``),
        both played in one rollout; only the eval rows' episodes are dumped."""
        turns = self.eval_settings.max_turns
        with self.metrics.timer("evaluate"):
            rows = self.eval_rows + self.select_rows
            played = self._play(rows, self.eval_settings, self.cfg.trainer.seed, "evaluate")
            trajs, chosen = split_evaluation(played, len(self.eval_rows))
            metrics = eval_metrics(trajs, self.eval_rows, turns)
            if self.cfg.trainer.dump_eval_results:
                name = f"global_step_{self.state.global_step}"
                if self.checkpointer is not None:
                    self.checkpointer.dump_eval(trajs, metrics, name)
                else:
                    dump_eval(trajs, metrics, self.run_dir / "eval" / name, num_gifs=2)
            if self.select_rows:
                metrics |= select_metrics(chosen, self.select_rows, turns)
        self.metrics.add_many(metrics)
        return metrics

    def throughput(self, played: Sequence[Trajectory], seconds: float) -> None:
        """Episodes played and tokens generated per wall second of the step."""
        if seconds > 0:
            tokens = sum(t.generated_tokens for t in played)
            self.metrics.add_many(
                {
                    "throughput/episodes_per_s": len(played) / seconds,
                    "throughput/generated_tokens_per_s": tokens / seconds,
                }
            )

    def keep_best(self, metrics: dict[str, float]) -> None:
        """Export the policy as the run's best when this evaluation's picking metric
        (``best_metric``: select/all/pass_at_1 with selection rows, else eval/all/pass_at_1)
        beats every earlier one's (ties keep the earlier step)."""
        metric, step = self.best_metric, self.state.global_step
        value = metrics.get(metric)
        if value is None or not beats_best(self.state, metric, value, step):
            return
        if self.cfg.trainer.export_best and self.checkpointer is not None:
            # best.json also keeps the reported eval figure of a step the selection set picked.
            picked_elsewhere = metric != EVAL_METRIC and EVAL_METRIC in metrics
            also = {EVAL_METRIC: metrics[EVAL_METRIC]} if picked_elsewhere else {}
            with self.metrics.timer("export"):
                dest = self.checkpointer.export_best(
                    self.group.export, step, value, metric=metric, also=also
                )
            print(
                f"exported the best policy so far (step {step}, {metric} {value:.1%}) to {dest}",
                flush=True,
            )

    def export(self, step: int) -> None:
        """The policy as ``export_path/global_step_<step>/policy``, saying where."""
        dest = self.checkpointer.export(self.group.export, step)
        self._exported_step = step
        print(f"exported the policy of step {step} to {dest}", flush=True)

    def log(self, step: int) -> None:
        # Every step, so a dashboard's series is continuous (a gauge of the run's state).
        self.metrics.add("train/restarts", self.restarts)
        self.loggers.log(self.metrics.flush(step), step)

    # -- state ----------------------------------------------------------------------
    def checkpointed(self) -> dict[str, Any]:
        """What a checkpoint saves and a resume restores, by name."""
        return {"trainer": self, "sampler": self.sampler, "group": self.group}

    def state_dict(self) -> dict[str, Any]:
        """The loop's own state (``LoopState``); the sampler and group keep theirs."""
        return dict(vars(self.state))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A key an older checkpoint lacks keeps this run's starting value, but for the
        # metric its best was picked by: eval/all/pass_at_1, the only one there was then.
        old = {"best_metric": EVAL_METRIC}
        self.state = LoopState(**(vars(self.state) | old | state))

    # -- helpers --------------------------------------------------------------------
    def _play(
        self, rows: Sequence[Row], settings: RolloutSettings, seed: int, phase: str, part: str = ""
    ) -> list[Trajectory]:
        """``group.generate`` with progress lines when it is long ("step 3 generate: 96/192
        episodes" and the seconds so far; with the console logger) and the phase's peak
        device memory."""
        label = f"step {self.state.global_step} {phase}" + (f" ({part})" if part else "")
        total = len(rows) * settings.n_samples_per_prompt
        with (
            self._peak_memory(phase),
            Progress(label, total, enabled=self.show_progress) as progress,
        ):
            trajs = self.group.generate(rows, settings, seed=seed, progress=progress)
        stop_if_all_env_errors(trajs, label)
        return trajs

    @contextmanager
    def _peak_memory(self, phase: str) -> Iterator[None]:
        """``perf/peak_memory_gb/<phase>`` of the work inside, where the group measures it."""
        peak = getattr(self.group, "peak_memory_gb", None)  # groups without devices have none
        if peak is not None:
            peak()  # the phase's count starts here
        yield
        gb = peak() if peak is not None else None
        if gb is not None:
            self.metrics.add(peak_memory_metric(phase), gb, reduce="max")

    def _seed(self, step: int) -> int:
        return self.cfg.trainer.seed * 1_000_003 + step

    @staticmethod
    def _due(interval: int, step: int) -> bool:
        return interval > 0 and step % interval == 0
