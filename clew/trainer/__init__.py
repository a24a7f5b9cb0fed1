"""The training loops and their assembly: GRPO, SFT with DAgger, and a recipe's pipeline.

``clew.trainer.launch`` builds a run from a config (data, worker group, engine, loggers,
checkpoints); ``clew.trainer.grpo`` and ``clew.trainer.sft`` are the loops;
``clew.trainer.pipeline`` chains dataset, model, SFT and GRPO for ``clew pipeline``, and
``clew.trainer.heldout`` is its 'test' stage (GRPO's policies on held-out mazes).
"""
