"""Assembling a training run from a config: data, worker, engine, loggers, checkpoints.

``run_grpo(cfg)`` is what ``clew train`` runs. The run folder is ``trainer.log_path /
trainer.run_name``: the resolved ``config.yaml``, ``metrics.jsonl``, TensorBoard events
and, unless ``trainer.export_path`` says otherwise, checkpoints and exports. The policy
workers (``build_worker_group``, ``ray_worker_group``), where they run
(``placement_device``) and the run's rows (``run_rows``) are built here for both loops;
SFT's run (``clew sft``) is assembled from them in ``clew.trainer.sft_launch``.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clew.checkpoint.layout import find_resume_step
from clew.checkpoint.state import Checkpointer
from clew.cluster.group import LocalWorkerGroup, WorkerGroup
from clew.cluster.placement import (
    PlacementSettings,
    check_gpus,
    local_gpus,
    worker_placement_group,
)
from clew.cluster.ray_calls import WorkerLost
from clew.config import ClewConfig, save_config
from clew.config.schema import PlacementConfig
from clew.config.settings import engine_options, optimizer_steps, worker_settings
from clew.data.rows import read_rows, with_env_option
from clew.envs.plugins import check_env_ids, import_env_modules, modules_env
from clew.errors import ClewError, ConfigError
from clew.inference.runtime import limit_device_memory, limit_host_threads, pick_device
from clew.metrics import make_loggers, with_ray_metrics
from clew.metrics.progress import library_bars_unless_tty
from clew.models.precision import policy_precision
from clew.ray_connect import connect_ray
from clew.train import PolicyWorker, WorkerSettings
from clew.trainer.grpo import GRPOTrainer


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's random generators seeded, before a run is built."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_dir_of(cfg: ClewConfig) -> Path:
    return Path(cfg.trainer.log_path) / cfg.trainer.run_name


def placement_settings(pl: PlacementConfig) -> PlacementSettings:
    """``trainer.placement`` as the settings ``clew.cluster.placement`` takes; the placement
    timeout is resolved here (``PlacementConfig.placement_timeout``: a bad
    ``SKYRL_RAY_PG_TIMEOUT_IN_S`` is a ``ConfigError``)."""
    timeout_s, source = pl.placement_timeout()
    return PlacementSettings(
        policy_num_nodes=pl.policy_num_nodes,
        policy_num_gpus_per_node=pl.policy_num_gpus_per_node,
        num_cpu_workers=pl.num_cpu_workers,
        timeout_s=timeout_s,
        timeout_source=source,
    )


def placement_device(cfg: ClewConfig) -> tuple[torch.device, bool]:
    """Where the policy workers of ``trainer.placement`` run, and whether they are GPU
    workers on Ray; a GPU placement this machine cannot hold is refused here."""
    t = cfg.trainer
    pl = t.placement
    on_gpus = pl.num_gpus > 1 or _gpu_from_cluster(cfg)
    if on_gpus and not os.environ.get("RAY_ADDRESS"):  # a cluster's GPUs are counted on it
        found = 0 if t.device == "cpu" else local_gpus()
        where = "this machine" + (" with trainer.device=cpu" if t.device == "cpu" else "")
        check_gpus(placement_settings(pl), found, where)
    if on_gpus:
        return torch.device("cuda"), True
    device = torch.device("cpu") if pl.num_cpu_workers > 1 else pick_device(t.device)
    if t.flex_attention and device.type != "cuda":
        raise ConfigError(
            f"trainer.flex_attention=true needs a CUDA device, and this run's policy is on "
            f"{device.type} (FlexAttention has no backward there): set it false"
        )
    return device, False


def _gpu_from_cluster(cfg: ClewConfig) -> bool:
    """One GPU asked by a driver that has none, on a Ray cluster (``RAY_ADDRESS``) that has
    GPUs: the driver of a ``ray job submit`` runs on the head node, a CPU node in the usual
    cluster, so its one worker is a Ray actor on a GPU node rather than this process on its
    CPU. On a cluster without GPUs the run stays in this process (on its CPU), unless
    ``trainer.device=cuda`` asks for a GPU, which is then refused."""
    t, pl = cfg.trainer, cfg.trainer.placement
    if not (
        pl.num_gpus == 1
        and pl.num_cpu_workers <= 1
        and t.device != "cpu"
        and os.environ.get("RAY_ADDRESS")
        and local_gpus() == 0
    ):
        return False
    import ray

    connect_ray(None)
    found = ray.cluster_resources().get("GPU", 0)
    if t.device == "cuda":
        check_gpus(placement_settings(pl), found, "the Ray cluster")
    return found >= 1


def uses_ray(cfg: ClewConfig, on_gpus: bool) -> bool:
    """Whether the policy workers are Ray actors (GPU workers, or several CPU workers)."""
    return on_gpus or cfg.trainer.placement.num_cpu_workers > 1


def ray_worker_group(
    cfg: ClewConfig,
    model_path: str | Path,
    settings: WorkerSettings,
    dtype: Any,
    device: torch.device,
    on_gpus: bool,
    run_name: str,
    **worker_options: Any,
) -> Any:
    """``trainer.placement.num_workers`` data-parallel workers of ``model_path`` on Ray,
    joined or started here (then shut down with the group); their actors are named
    ``clew-<run_name>-worker-<rank>``."""
    from clew.cluster.ray_group import RayWorkerGroup

    pl = cfg.trainer.placement
    started = connect_ray(None if on_gpus else pl.num_cpu_workers)
    try:
        group = RayWorkerGroup(
            model_path,
            settings,
            pl.num_workers,
            dtype=dtype,
            device=device.type,
            placement_group=worker_placement_group(placement_settings(pl), on_gpus),
            on_this_machine=started and not os.environ.get("RAY_ADDRESS"),
            env_vars=modules_env(cfg.environment.modules),
            name=f"clew-{run_name}",
            seed=cfg.trainer.seed,
            strategy=cfg.trainer.strategy,
            **worker_options,
        )
    except BaseException:
        if started:
            import ray

            ray.shutdown()
        raise
    group.owns_ray = started
    return group


def build_worker_group(cfg: ClewConfig, num_train_rows: int) -> WorkerGroup:
    """The run's policy workers (``trainer.placement``): one in this process, else one Ray
    actor per GPU (a placement group) or per CPU worker, on Ray joined or started here."""
    require_model_path(cfg)
    t = cfg.trainer
    device, on_gpus = placement_device(cfg)
    lora = t.policy.model.lora
    precision = "bf16-mixed" if t.bf16 else "32-true"
    dtype, autocast = policy_precision(device, precision, lora.rank > 0)
    settings = worker_settings(
        t.policy.optimizer_config,
        lora,
        num_training_steps=optimizer_steps(cfg, num_train_rows),
        kl_reference=t.algorithm.use_kl_loss,
        autocast_bf16=autocast,
        gradient_checkpointing=t.gradient_checkpointing,
        remove_padding=t.remove_microbatch_padding,
        max_tokens_per_microbatch=max(t.max_tokens_per_microbatch, 0) or None,  # -1: off
        logprobs_chunk_size=t.logprobs_chunk_size,
        flex_attention=t.flex_attention,
    )
    options = engine_options(cfg)
    allowed = [
        tuple(sp.allowed_tokens)
        for sp in (cfg.generator.sampling_params, cfg.generator.eval_sampling_params)
        if sp.allowed_tokens
    ]
    if uses_ray(cfg, on_gpus):
        return ray_worker_group(
            cfg,
            t.policy.model.path,
            settings,
            dtype,
            device,
            on_gpus,
            t.run_name,
            engine=options,
            allowed_tokens=allowed,
        )
    limit_host_threads(device)
    limit_device_memory(device, t.gpu_memory_fraction)
    worker = PolicyWorker.from_pretrained(t.policy.model.path, settings, dtype=dtype, device=device)
    engine = options.build(worker.model, worker.chat, autocast=autocast)
    # A token text that is not one token fails here, before any rollout.
    for tokens in allowed:
        engine.allowed_ids(tokens)
    return LocalWorkerGroup(worker, engine)


def run_grpo(cfg: ClewConfig) -> dict[str, float]:
    """Run GRPO as configured; returns the last evaluation's metrics.

    Every env id of the data must resolve in this process before anything starts, and in
    every worker before the first step (``clew.envs.plugins``): an ``EnvError`` names the
    first that does not and how to register it. A Ray worker that dies (``WorkerLost``)
    costs the run its worker group, not the run: a new group goes on from the run's latest
    checkpoint, up to ``trainer.max_restarts`` times, after which a ``ClewError`` names the
    restarts used and the last cause. transformers' progress bars are drawn only on a
    terminal (``clew.metrics.progress``).
    """
    with library_bars_unless_tty():
        return _run_grpo(cfg)


def check_runnable(cfg: ClewConfig) -> None:
    """What a GRPO run refuses before loading anything: no training data, no policy, a
    selection set without the eval set it is played beside."""
    if not cfg.data.train_data:
        raise ConfigError(
            "data.train_data is empty: give one or more parquet files from `clew dataset`"
        )
    if cfg.data.select_data and not cfg.data.val_data:
        raise ConfigError(
            "data.select_data is played at GRPO's evaluations of data.val_data, which is "
            "empty: set data.val_data too, or drop data.select_data"
        )
    require_model_path(cfg)


def require_model_path(cfg: ClewConfig) -> None:
    if not cfg.trainer.policy.model.path:
        raise ConfigError("trainer.policy.model.path is required: a local checkpoint directory")


def _run_grpo(cfg: ClewConfig) -> dict[str, float]:
    check_runnable(cfg)
    import_env_modules(cfg.environment.modules)
    with_ray_metrics(cfg.trainer.logger, cfg.trainer.placement.num_workers)  # fails before loading
    train_rows, eval_rows = run_rows(cfg)
    select_rows = prompt_rows(cfg, cfg.data.select_data)
    check_env_ids(env_ids_of(train_rows, eval_rows, select_rows))
    run_dir = run_dir_of(cfg)
    save_config(cfg, run_dir)
    attempt_cfg, restarts = cfg, 0
    while True:
        try:
            rows = (train_rows, eval_rows, select_rows)
            return _grpo_attempt(attempt_cfg, rows, run_dir, restarts)
        except WorkerLost as lost:
            limit = cfg.trainer.max_restarts
            if restarts >= limit:
                raise ClewError(
                    f"the run failed after {restarts} restart(s) of its worker group "
                    f"(trainer.max_restarts={limit}); last cause: {lost}"
                ) from lost
            restarts += 1
            attempt_cfg, step = _restart_config(cfg, run_dir)
            where = (
                f"from the checkpoint of global step {step}"
                if step is not None
                else "from step 0 (no checkpoint yet)"
            )
            print(
                f"{lost}; restart {restarts} of {limit}: rebuilding the worker group and "
                f"going on {where}",
                flush=True,
            )


def _grpo_attempt(
    cfg: ClewConfig, rows: tuple[list, list, list], run_dir: Path, restarts: int
) -> dict[str, float]:
    """One try at the run on a new worker group (``rows``: training, eval and selection
    rows), resuming as ``trainer.resume_mode`` says."""
    train_rows, eval_rows, select_rows = rows
    seed_everything(cfg.trainer.seed)
    group = build_worker_group(cfg, len(train_rows))
    try:  # workers on Ray end with the run, however it ends
        group.check_envs(env_ids_of(train_rows, eval_rows, select_rows))
        loggers = make_loggers(
            with_ray_metrics(cfg.trainer.logger, cfg.trainer.placement.num_workers),
            run_dir,
            cfg.trainer.project_name,
            cfg.trainer.run_name,
            config=cfg.model_dump(mode="json"),
        )
        checkpointer = Checkpointer(cfg, run_dir)
        trainer = GRPOTrainer(
            cfg, group, train_rows, eval_rows, loggers, run_dir, checkpointer, select_rows
        )
        trainer.restarts = restarts
        try:
            return trainer.fit()
        finally:
            loggers.close()
    finally:
        group.shutdown()


def _restart_config(cfg: ClewConfig, run_dir: Path) -> tuple[ClewConfig, int | None]:
    """The config a restart runs with, and the step it goes on from: this run's newest
    checkpoint when it wrote one, else the start the run was given (its resume_mode)."""
    checkpointer = Checkpointer(cfg, run_dir)
    step, _ = find_resume_step(checkpointer.storage, checkpointer.ckpt_path)
    if step is None:
        if cfg.trainer.resume_mode != "none":
            point = checkpointer.resume_point()
            step = point.step if point is not None else None
        return cfg, step
    trainer = cfg.trainer.model_copy(update={"resume_mode": "latest"})
    return cfg.model_copy(update={"trainer": trainer}), step


def env_ids_of(*row_lists: list) -> list[str]:
    """The distinct env ids of the rows, sorted."""
    return sorted({r.env_id for rows in row_lists for r in rows})


def run_rows(cfg: ClewConfig) -> tuple[list, list]:
    """The run's training and evaluation rows, under the run's prompt format if it sets one."""
    return prompt_rows(cfg, cfg.data.train_data), prompt_rows(cfg, cfg.data.val_data)


def prompt_rows(cfg: ClewConfig, paths: list[str]) -> list:
    """The rows of the parquet files ``paths``, under the run's prompt format if it sets one."""
    rows = [r for p in paths for r in read_rows(p)]
    if (fmt := cfg.environment.prompt_format) is not None:
        rows = with_env_option(rows, "prompt_format", fmt)
    return rows
