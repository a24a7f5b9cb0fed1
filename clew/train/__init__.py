"""Training: the policy worker (forward, PPO and SFT steps, optimizer state) and SFT warm-up.

``PolicyWorker`` is a plain class, so it runs in tests and single-process jobs as is; it
learns from a ``TrainingBatch`` (data) under ``PPOSettings``, so a Ray actor can wrap it
with the same methods.
"""

from clew.train.demonstrations import Demonstration, demonstrations
from clew.train.lora import apply_lora
from clew.train.model_batch import ModelBatch, Sample, collate, micro_batches, target_values
from clew.train.settings import PPOSettings, WorkerSettings
from clew.train.sft import SFTResult, SFTTrainer
from clew.train.training_batch import TrainingBatch
from clew.train.worker import PolicyWorker

__all__ = [
    "Demonstration",
    "ModelBatch",
    "PPOSettings",
    "PolicyWorker",
    "SFTResult",
    "SFTTrainer",
    "Sample",
    "TrainingBatch",
    "WorkerSettings",
    "apply_lora",
    "collate",
    "demonstrations",
    "micro_batches",
    "target_values",
]
