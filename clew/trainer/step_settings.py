"""The settings that change from step to step of a GRPO run.

Two may (``clew.algorithms.entropy_control``): the training rollouts' temperature
(``generator.sampling_params.temperature_end``), which the update scores the step's tokens
at too, and, under ``trainer.algorithm.entropy_target``, the entropy bonus's weight, adapted
after each update from its ``policy/entropy``. Each step's values reach the rollouts and the
update as settings; the weight's state is the loop's (``LoopState``), checkpointed with it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from clew.algorithms import adapt_entropy_coef, entropy_coef_in_effect, linear_schedule
from clew.config import ClewConfig
from clew.rollout.loop import RolloutSettings
from clew.train.settings import PPOSettings


class EntropyState(Protocol):
    entropy_coef: float
    last_entropy: float | None


class StepSettings:
    """Each step's rollout and update settings, from the run's fixed ones."""

    def __init__(
        self,
        cfg: ClewConfig,
        total_steps: int,
        rollout: RolloutSettings,
        ppo: PPOSettings,
    ) -> None:
        self.sampling = cfg.generator.sampling_params
        self.algorithm = cfg.trainer.algorithm
        self.total_steps = total_steps  # where the temperature schedule ends, as the LR's
        self.base_rollout, self.base_ppo = rollout, ppo

    def temperature(self, step: int) -> float:
        """The sampling temperature of step ``step``'s training rollouts: constant, or on
        the schedule to ``generator.sampling_params.temperature_end`` at the last step."""
        sp = self.sampling
        if sp.temperature_end is None:
            return sp.temperature
        return linear_schedule(sp.temperature, sp.temperature_end, step, self.total_steps)

    def rollout(self, step: int) -> RolloutSettings:
        """The training rollouts' settings at ``step`` (its temperature)."""
        base = self.base_rollout
        return replace(base, sampling=replace(base.sampling, temperature=self.temperature(step)))

    def update(self, step: int, state: EntropyState) -> PPOSettings:
        """The update's settings at ``step``: the logprobs scored at the temperature the
        step's rollouts sampled with, the entropy bonus at its weight in effect."""
        settings = self.base_ppo
        if self.sampling.temperature_end is not None:  # > 0 (validated)
            settings = replace(settings, temperature=self.temperature(step))
        alg = self.algorithm
        if alg.use_entropy_loss and alg.entropy_target is not None:
            coef = entropy_coef_in_effect(
                state.entropy_coef, state.last_entropy, alg.entropy_target
            )
            settings = replace(settings, entropy_loss_coef=coef)
        return settings

    def adapt_entropy_coef(self, state: EntropyState, stats: dict[str, float]) -> None:
        """Under ``entropy_target``: the bonus's weight after an update that measured
        ``policy/entropy`` (unchanged when it did not)."""
        alg = self.algorithm
        entropy = stats.get("policy/entropy")
        if alg.entropy_target is None or entropy is None:
            return
        if stats.get("policy/optimizer_steps", 1) == 0:  # no mini-batch had tokens
            return
        state.entropy_coef = adapt_entropy_coef(
            state.entropy_coef,
            float(entropy),
            target=alg.entropy_target,
            step_size=alg.entropy_coef_step,
            min_coef=alg.entropy_coef_min,
            max_coef=alg.entropy_coef_max,
        )
        state.last_entropy = float(entropy)
