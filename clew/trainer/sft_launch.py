"""Assembling an SFT run from a config: ``run_sft_stage(cfg)`` is what ``clew sft`` runs.

The run folder is ``trainer.log_path / sft.run_name`` (``sft_run_dir``). The policy runs
where GRPO's would (``trainer.placement``, on the worker groups of
``clew.trainer.launch``), and is evaluated by greedy pass@1 and agreement with the expert
(``sft_eval_fn``); the loop itself is ``clew.trainer.sft``.
"""

from __future__ import annotations

from pathlib import Path

from clew.checkpoint.state import Checkpointer
from clew.config import ClewConfig, save_config
from clew.config.settings import engine_options, worker_settings
from clew.envs.plugins import check_env_ids, import_env_modules
from clew.errors import ConfigError
from clew.inference.engine import EngineOptions
from clew.inference.runtime import limit_host_threads
from clew.inference.sampling import SamplingParams
from clew.metrics import make_loggers, with_ray_metrics
from clew.metrics.progress import library_bars_unless_tty
from clew.models.precision import policy_precision
from clew.rollout.evaluation import eval_metrics
from clew.rollout.loop import RolloutSettings, play_model
from clew.train import PolicyWorker
from clew.trainer.agreement import solver_agreement
from clew.trainer.launch import (
    env_ids_of,
    placement_device,
    ray_worker_group,
    run_rows,
    seed_everything,
    uses_ray,
)
from clew.trainer.sft import EvalFn, SFTResult, SFTTrainer


def sft_run_dir(cfg: ClewConfig) -> Path:
    return Path(cfg.trainer.log_path) / cfg.sft.run_name


def sft_eval_fn(
    rows: list, keep_last_k_images: int | None, autocast: bool, engine: EngineOptions
) -> EvalFn:
    """SFT's evaluation: greedy pass@1 on ``rows``, played on an engine built with
    ``engine``, and the policy's agreement with the expert on the expert's own path
    (``clew.trainer.agreement``)."""
    turns = max(r.max_turns for r in rows)
    settings = RolloutSettings(
        1,
        turns,
        8192,
        SamplingParams(temperature=0.0, max_tokens=16),
        keep_last_k_images=keep_last_k_images,
    )

    def eval_fn(model, chat, step: int) -> dict[str, float]:
        trajs = play_model(model, chat, rows, settings, autocast=autocast, engine=engine)
        agreement = solver_agreement(
            model, chat, rows, image_window=keep_last_k_images, autocast=autocast
        )
        return eval_metrics(trajs, rows, turns) | agreement

    return eval_fn


def run_sft_stage(cfg: ClewConfig, *, eval_fn: EvalFn | None = None) -> SFTResult:
    """Run SFT as configured (``clew sft``); where the final policy went and how it evaluated.

    The run folder is ``trainer.log_path / sft.run_name``: ``config.yaml``, ``metrics.jsonl``,
    ``ckpts/`` and, unless ``sft.export_path`` says otherwise, ``exports/`` (``final/policy``,
    ``global_step_N/policy``, ``best/``). ``trainer.resume_mode=latest`` goes on from the
    run's newest checkpoint; one of another run (another model, data, adapter shape, batch
    size, seed or environment) is refused, listing what differs, before anything is written.
    ``eval_fn`` replaces the evaluation on ``data.val_data``. The data's env ids must
    resolve here and in every Ray worker, as for ``run_grpo``.
    """
    with library_bars_unless_tty():
        return _run_sft_stage(cfg, eval_fn)


def _run_sft_stage(cfg: ClewConfig, eval_fn: EvalFn | None) -> SFTResult:
    s = cfg.sft
    if not s.model_path:
        raise ConfigError(
            "sft.model_path is required: the starting checkpoint directory (`clew init-model` "
            "output or a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint)"
        )
    if not cfg.data.train_data:
        raise ConfigError(
            "data.train_data is empty: give one or more parquet files from `clew dataset`"
        )
    evaluated = eval_fn is not None or bool(cfg.data.val_data)
    wanted = {"sft.stop_at_pass": s.stop_at_pass is not None, "sft.export_best": s.export_best}
    for key, on in wanted.items():
        if on and not evaluated:
            raise ConfigError(f"{key} needs an evaluation: set data.val_data")
    import_env_modules(cfg.environment.modules)
    train_rows, eval_rows = run_rows(cfg)
    check_env_ids(env_ids_of(train_rows, eval_rows))
    run_dir = sft_run_dir(cfg)
    checkpointer = Checkpointer(cfg, run_dir, stage="sft")
    checkpointer.resume_point()  # another run's checkpoint fails here, before any write
    save_config(cfg, run_dir)
    device, on_gpus = placement_device(cfg)
    dtype, autocast = policy_precision(device, s.precision, s.lora.rank > 0)
    seed_everything(s.seed)
    settings = worker_settings(
        s.optimizer_config,
        s.lora,
        num_training_steps=s.steps,
        autocast_bf16=autocast,
        pack_sequences=s.pack_sequences,
        gradient_checkpointing=cfg.trainer.gradient_checkpointing,
        logprobs_chunk_size=cfg.trainer.logprobs_chunk_size,
        flex_attention=cfg.trainer.flex_attention,
    )
    workers = cfg.trainer.placement.num_workers
    engine = engine_options(cfg)  # evaluations and DAgger episodes run on the run's engine
    if eval_fn is None and eval_rows:
        eval_fn = sft_eval_fn(eval_rows, cfg.generator.keep_last_k_images, autocast, engine)
    if uses_ray(cfg, on_gpus):  # the workers GRPO would run on (trainer.placement)
        policy = ray_worker_group(cfg, s.model_path, settings, dtype, device, on_gpus, s.run_name)
        try:
            policy.check_envs(env_ids_of(train_rows, eval_rows))
        except BaseException:
            policy.shutdown()
            raise
    else:
        limit_host_threads(device)
        policy = PolicyWorker.from_pretrained(s.model_path, settings, dtype=dtype, device=device)
    try:
        loggers = make_loggers(
            with_ray_metrics(cfg.trainer.logger, workers),
            run_dir,
            cfg.trainer.project_name,
            s.run_name,
            config=cfg.model_dump(mode="json"),
        )
        try:
            trainer = SFTTrainer(
                cfg,
                policy,
                train_rows,
                checkpointer,
                loggers,
                eval_fn=eval_fn,
                autocast=autocast,
                engine=engine,
            )
            return trainer.fit()
        finally:
            loggers.close()
    finally:
        if workers > 1:
            policy.shutdown()
