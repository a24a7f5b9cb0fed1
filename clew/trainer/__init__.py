"""The training loops and their assembly: GRPO, SFT with DAgger, and a recipe's pipeline.

``clew.trainer.launch`` builds a GRPO run from a config (data, worker group, engine,
loggers, checkpoints) and ``clew.trainer.sft_launch`` an SFT run; ``clew.trainer.grpo`` and
``clew.trainer.sft`` are the loops; ``clew.trainer.pipeline`` chains dataset, model, SFT and
GRPO for ``clew pipeline`` (``clew.trainer.stage_records`` keeps what each stage made), and
``clew.trainer.heldout`` is its 'test' stage (GRPO's policies on held-out mazes).
"""
