"""The policy worker: one model, its forward, its PPO and SFT updates, its optimizer state.

``PolicyWorker`` is a plain class, so it runs in tests and single-process jobs as is; it
learns from a ``TrainingBatch`` (data) under ``PPOSettings``, so a Ray actor can wrap it
with the same methods. Its face is a few public methods: ``compute_logprobs``,
``train_batch``, ``sft_step``, ``state_dict`` / ``load_state_dict`` and ``save_pretrained``.
"""

from clew.train.settings import PPOSettings, WorkerSettings
from clew.train.training_batch import TrainingBatch
from clew.train.worker import PolicyWorker

__all__ = ["PPOSettings", "PolicyWorker", "TrainingBatch", "WorkerSettings"]
