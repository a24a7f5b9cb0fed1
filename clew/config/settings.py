"""From the configuration to the typed settings each component takes.

Not imported by ``clew.config`` itself (these import the components). The components
never read the config: the rollout loop gets ``RolloutSettings``, the PPO update
``PPOSettings``, a policy worker ``WorkerSettings`` and its engine ``EngineOptions``; these
functions are the one place where config keys become those fields.
"""

from __future__ import annotations

from typing import Any

from clew.algorithms import get_estimator, policy_loss_name
from clew.config.algorithm import AlgorithmConfig
from clew.config.schema import ClewConfig, LoraConfig, OptimizerConfig
from clew.inference.engine import EngineOptions
from clew.inference.sampling import SamplingParams
from clew.rollout.loop import RolloutSettings
from clew.train.settings import PPOSettings, WorkerSettings


def rollout_settings(cfg: ClewConfig, evaluation: bool) -> RolloutSettings:
    g = cfg.generator
    sp = g.eval_sampling_params if evaluation else g.sampling_params
    return RolloutSettings(
        n_samples_per_prompt=g.eval_n_samples_per_prompt if evaluation else g.n_samples_per_prompt,
        max_turns=g.max_turns,
        max_input_length=g.max_input_length,
        keep_last_k_images=g.keep_last_k_images,
        reply_prefix=g.reply_prefix,
        reply_suffix=g.reply_suffix,
        env_workers=g.env_workers,
        reward_rule=cfg.environment.reward_rule,
        keep_frames=not evaluation,
        state_keys=not evaluation
        and "state_keys" in get_estimator(cfg.trainer.algorithm.advantage_estimator).needs,
        sampling=SamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            max_tokens=sp.max_generate_length,
            stop=tuple(sp.stop or ()),
            allowed_tokens=tuple(sp.allowed_tokens or ()),
        ),
    )


def engine_options(cfg: ClewConfig) -> EngineOptions:
    ie = cfg.generator.inference_engine
    return EngineOptions(
        cuda_graphs=not ie.enforce_eager,
        prefill_cuda_graphs=ie.prefill_cuda_graphs and not ie.enforce_eager,
        vision_cuda_graphs=ie.vision_cuda_graphs and not ie.enforce_eager,
        decode_attention=ie.decode_attention,
        prefill_attention=ie.prefill_attention,
        fused_pointwise=ie.fused_pointwise,
        # The KV cache's share stays within the process's own (trainer.gpu_memory_fraction).
        gpu_memory_utilization=min(
            ie.gpu_memory_utilization, cfg.trainer.gpu_memory_fraction or 1.0
        ),
        max_cache_mb=ie.max_cache_mb,
    )


def policy_loss_options(a: AlgorithmConfig) -> dict[str, Any]:
    """The keyword arguments ``trainer.algorithm`` gives its policy loss: PPO's clip for
    'regular' and registered losses (the arguments of ``ppo_clip_loss``), the loss's own
    section for the others (SkyRL's keys, so each loss reads the settings SkyRL's does)."""
    name = policy_loss_name(a.policy_loss_type)
    clip = {"eps_clip_low": a.eps_clip_low, "eps_clip_high": a.eps_clip_high}
    own = {
        "gspo": clip,
        "cispo": a.cispo.model_dump(),
        "clip_cov": clip | a.clip_cov.model_dump(),
        "kl_cov": a.kl_cov.model_dump(),
        "sapo": a.sapo.model_dump(),
    }
    return own.get(name, clip | {"clip_ratio_c": a.clip_ratio_c})


def ppo_settings(cfg: ClewConfig) -> PPOSettings:
    """The update's loss and geometry; the mini-batch counts the group's trajectories."""
    a, t, g = cfg.trainer.algorithm, cfg.trainer, cfg.generator
    temperature = g.sampling_params.temperature
    return PPOSettings(
        policy_loss=policy_loss_name(a.policy_loss_type),
        loss_options=policy_loss_options(a),
        loss_reduction=a.loss_reduction,
        max_seq_len=g.max_input_length,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_estimator=a.kl_estimator_type,
        entropy_loss_coef=a.entropy_loss_coef if a.use_entropy_loss else 0.0,
        temperature=temperature if temperature > 0 else 1.0,
        allowed_tokens=tuple(g.sampling_params.allowed_tokens or ()),
        mini_batch_size=t.policy_mini_batch_size * g.n_samples_per_prompt,
        micro_batch_size=t.micro_train_batch_size_per_gpu,
        forward_micro_batch_size=t.micro_forward_batch_size_per_gpu,
        epochs=t.update_epochs_per_batch,
        recompute_old_logprobs=a.recompute_old_logprobs,
        use_tis=a.use_tis,
        tis_imp_ratio_cap=a.tis_imp_ratio_cap,
    )


def _data_steps(cfg: ClewConfig, num_rows: int) -> int:
    t = cfg.trainer
    steps = (num_rows // t.train_batch_size) * t.epochs
    if t.max_steps >= 0:  # the run ends there, so a decaying schedule must reach its end there
        steps = min(steps, t.max_steps)
    return steps


def training_steps(cfg: ClewConfig, num_rows: int) -> int:
    """The GRPO run's training steps over ``num_rows`` training rows (at least 1): the
    data's, capped at ``trainer.max_steps``; the temperature schedule ends there."""
    return max(1, _data_steps(cfg, num_rows))


def optimizer_steps(cfg: ClewConfig, num_rows: int) -> int:
    """The optimizer steps of those training steps; the learning-rate schedule ends there."""
    t = cfg.trainer
    return max(
        1,
        _data_steps(cfg, num_rows)
        * (t.train_batch_size // t.policy_mini_batch_size)
        * t.update_epochs_per_batch,
    )


def worker_settings(
    opt: OptimizerConfig, lora: LoraConfig, *, num_training_steps: int, **extra: Any
) -> WorkerSettings:
    """The worker's settings from a stage's optimizer and LoRA sections (GRPO's or SFT's)."""
    return WorkerSettings(
        lr=opt.lr,
        adam_betas=tuple(opt.adam_betas),
        weight_decay=opt.weight_decay,
        max_grad_norm=opt.max_grad_norm,
        scheduler=opt.scheduler,
        num_warmup_steps=opt.num_warmup_steps,
        num_training_steps=num_training_steps,
        lora_rank=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        lora_target_modules=lora.target_modules,
        **extra,
    )
