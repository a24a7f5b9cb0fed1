"""The GRPO loop's own state (``LoopState``): what it carries from step to step and a
checkpoint saves beside the sampler's and the worker group's (``GRPOTrainer.state_dict``).

A resumed run restores it, so it goes on as the uninterrupted run would: as many prompt
batches per step as dynamic sampling last needed, the best evaluation so far
(``clew.trainer.selection.beats_best``) and the entropy bonus's adaptive weight
(``clew.trainer.step_settings``).
"""

from __future__ import annotations

from dataclasses import dataclass

from clew.trainer.selection import EVAL_METRIC


@dataclass
class LoopState:
    global_step: int = 0
    # Batches of prompts dynamic sampling needed last step: the next step plays that many
    # in one go (checkpointed, so a resumed run plays what the uninterrupted one would).
    sample_batches: int = 1
    # The best value so far of the metric that picks (trainer.export_best), its step and the
    # metric's name (clew.trainer.selection.beats_best), checkpointed so a resumed run
    # measures its evaluations against the best of the steps it goes on from. best_metric's
    # default is what checkpoints written before it existed measured.
    best_eval: float = -1.0
    best_step: int = -1
    best_metric: str = EVAL_METRIC
    # The entropy bonus's adaptive weight (trainer.algorithm.entropy_target) and the
    # policy/entropy of the last update, which set the next update's weight; checkpointed,
    # so a resumed run weighs its bonus as the uninterrupted one would.
    entropy_coef: float = 0.0
    last_entropy: float | None = None
