"""Plain settings of the policy worker and of one PPO update.

Dataclasses, not the pydantic config: the worker must run where the whole config does not
exist (tests now, Ray actors once workers on Ray exist), and the trainer maps
``trainer.policy.*`` and ``trainer.algorithm.*`` onto these few values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SCHEDULERS = ("constant_with_warmup", "cosine", "linear")


@dataclass(frozen=True)
class WorkerSettings:
    """Optimizer, schedule and adapter settings (``trainer.policy.*`` of the config).

    ``num_training_steps`` counts optimizer steps (one per mini-batch) and is required by
    the ``cosine`` and ``linear`` schedules. ``lora_rank`` 0 trains every weight.
    ``kl_reference`` keeps a frozen copy of the initial weights for the KL term when there
    is no LoRA (with LoRA the reference is the adapter switched off, and this is ignored).
    ``autocast_bf16`` computes in bfloat16 over the weights' own dtype (float32 master
    weights: ``clew.models.precision``); bfloat16 weights on CUDA always compute so.
    ``pack_sequences`` packs an SFT batch's sequences into rows
    (``clew.train.model_batch.collate(pack=True)``): the same loss and gradient with less compute
    spent on padding; the micro-batch size then counts packed rows.

    The shape of every forward the worker runs (updates and ``compute_logprobs`` alike, so
    recomputed logprobs match the update's): ``remove_padding`` lays each micro-batch's
    sequences end to end in one row with no padding, each attending only to itself
    (``clew.models.packed_attention``); ``max_tokens_per_microbatch`` forms micro-batches by
    tokens instead of by sequence count (``clew.train.micro_batches.token_micro_batches``);
    ``logprobs_chunk_size`` computes logprobs and entropies from the final hidden states
    that many tokens at a time (``clew.models.token_logprobs``), never holding the whole
    ``[tokens, vocabulary]`` logits. ``gradient_checkpointing`` recomputes each decoder
    layer's activations in backward instead of keeping them. ``flex_attention`` attends every
    forward's language layers through FlexAttention under a block mask of the batch's
    visibility (CUDA only for training). Each gives the
    same loss, gradients and logprobs as without it, to float rounding.
    """

    lr: float = 1e-6
    adam_betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    scheduler: str = "constant_with_warmup"
    num_warmup_steps: int = 0
    num_training_steps: int | None = None
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: str | list[str] = "all-linear"
    kl_reference: bool = False
    gradient_checkpointing: bool = False
    autocast_bf16: bool = False
    pack_sequences: bool = False
    remove_padding: bool = False
    max_tokens_per_microbatch: int | None = None
    logprobs_chunk_size: int | None = None
    flex_attention: bool = False

    def __post_init__(self) -> None:
        for name in ("max_tokens_per_microbatch", "logprobs_chunk_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive number of tokens or None, got {value}")


@dataclass(frozen=True)
class PPOSettings:
    """One PPO update: its loss (``trainer.algorithm.*``) and its geometry (``trainer.*``).

    ``policy_loss`` is a name in ``clew.algorithms.POLICY_LOSSES`` (the config's "regular"
    is "ppo_clip"), called with ``loss_options`` as keyword arguments besides the tensors, the
    reduction and TIS: its own settings, e.g. ``eps_clip_low``, ``eps_clip_high`` and
    ``clip_ratio_c`` for "ppo_clip" (``clew.config.settings.policy_loss_options`` picks them
    from ``trainer.algorithm``); empty, the loss's defaults. ``temperature`` and
    ``allowed_tokens`` must be the rollout's sampling ones. ``use_kl_loss``: the worker scores the batch under the KL reference (in micro
    batches of ``forward_micro_batch_size``) and adds ``kl_loss_coef`` times the KL term.

    The geometry: ``epochs`` passes over the batch, one optimizer step per mini-batch of
    ``mini_batch_size`` trajectories (None: the whole batch), each accumulated over micro
    batches of ``micro_batch_size`` trajectories. ``mini_batch_size`` counts the whole
    worker group's trajectories; a group of several workers hands each its share, with
    ``mini_batch_sizes`` the sizes of that share's mini-batches in order (some may be 0:
    every worker takes part in every optimizer step).

    Engine against trainer (``clew.algorithms.logprob_gap``): ``recompute_old_logprobs``
    makes the PPO "old" logprobs the trainer's own forward before the update (in micro
    batches of ``forward_micro_batch_size``) instead of the engine's sampling ones;
    ``use_tis`` implies it and weighs each token's loss by ``min(exp(old - engine),
    tis_imp_ratio_cap)``.
    """

    policy_loss: str = "ppo_clip"
    loss_options: Mapping[str, Any] = field(default_factory=dict)
    loss_reduction: str = "token_mean"
    max_seq_len: int | None = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_loss_coef: float = 0.0
    temperature: float = 1.0
    allowed_tokens: tuple[str, ...] = ()
    mini_batch_size: int | None = None
    mini_batch_sizes: tuple[int, ...] = ()
    micro_batch_size: int = 1
    forward_micro_batch_size: int = 8
    epochs: int = 1
    recompute_old_logprobs: bool = False
    use_tis: bool = False
    tis_imp_ratio_cap: float = -1.0
