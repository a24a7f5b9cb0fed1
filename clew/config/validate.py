"""Range and cross-field rules, checked on the final config before any work starts.

Why a separate pass: pydantic checks each value's type where it is declared, but rules such as
"the mini batch divides the train batch" span sections and must hold for the final config,
however it was assembled (YAML, overrides, code). ``validate`` runs every rule, reports every
failure at once, each tagged with the rule's name and the values involved, and raises
``ConfigError`` before any work starts.

Batch sizes are counted the SkyRL way: ``train_batch_size`` and ``policy_mini_batch_size`` are
in prompts, and each prompt yields ``n_samples_per_prompt`` trajectories; micro batches are
in trajectories per worker. So one optimizer step sees ``policy_mini_batch_size *
n_samples_per_prompt`` trajectories, which must split evenly into micro batches of
``micro_train_batch_size_per_gpu``. The rule does not involve the worker count: the workers
(GPUs, or the CPU workers of a machine without GPUs) take shares of each mini batch that
differ by at most one trajectory, each cut into micro batches of that size with a smaller
last one, and take the step one worker takes on the whole mini batch
(``TrainingBatch.split``), so any mini batch splits over any number of workers. Whether the
GPUs asked for exist is known only at launch (``clew.cluster.placement``), which refuses a
placement it cannot make.

On success ``validate`` warns about the SkyRL keys clew accepts but ignores
(``clew.config.ignored``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from clew.config.ignored import warn_ignored
from clew.config.keys import get_key
from clew.config.schema import ClewConfig
from clew.config.validate_algorithm import (
    entropy_floor_rules,
    pass_at_k_rules,
    policy_loss_rules,
    temperature_schedule_rules,
)
from clew.config.validate_names import check_prompt_format, named_functions, registered_estimator
from clew.errors import ConfigError

# Keys that count things and so must be >= 1.
COUNT_KEYS: tuple[str, ...] = (
    "generator.n_samples_per_prompt",
    "generator.eval_n_samples_per_prompt",
    "generator.max_turns",
    "generator.max_input_length",
    "generator.sampling_params.max_generate_length",
    "generator.eval_sampling_params.max_generate_length",
    "generator.inference_engine.num_engines",
    "generator.inference_engine.tensor_parallel_size",
    "generator.inference_engine.max_cache_mb",
    "trainer.epochs",
    "trainer.train_batch_size",
    "trainer.policy_mini_batch_size",
    "trainer.micro_forward_batch_size_per_gpu",
    "trainer.micro_train_batch_size_per_gpu",
    "trainer.update_epochs_per_batch",
    "trainer.max_prompt_length",
    "trainer.placement.policy_num_nodes",
    "trainer.placement.policy_num_gpus_per_node",
    "trainer.placement.ref_num_nodes",
    "trainer.placement.ref_num_gpus_per_node",
    "trainer.placement.num_cpu_workers",
    "sft.steps",
    "sft.batch_size",
    "sft.dagger.rows",
    "pipeline.test.rows",
)
# Step intervals: >= 1, or -1 for never.
INTERVAL_KEYS: tuple[str, ...] = (
    "trainer.eval_interval",
    "trainer.ckpt_interval",
    "trainer.hf_save_interval",
    "sft.eval_interval",
    "sft.ckpt_interval",
    "sft.hf_save_interval",
)
# Real numbers that must be > 0, and ones that must be >= 0.
POSITIVE_KEYS: tuple[str, ...] = (
    "trainer.policy.optimizer_config.lr",
    "trainer.policy.optimizer_config.max_grad_norm",
    "trainer.policy.model.lora.alpha",
    "sft.optimizer_config.lr",
    "sft.optimizer_config.max_grad_norm",
    "sft.lora.alpha",
)
NON_NEGATIVE_KEYS: tuple[str, ...] = (
    "trainer.policy.model.lora.rank",
    "trainer.policy.optimizer_config.num_warmup_steps",
    "trainer.policy.optimizer_config.weight_decay",
    "trainer.algorithm.kl_loss_coef",
    "trainer.algorithm.entropy_loss_coef",
    "sft.lora.rank",
    "sft.optimizer_config.num_warmup_steps",
    "sft.optimizer_config.weight_decay",
    "sft.dagger.interval",
    "sft.dagger.keep_rounds",
    "sft.dagger.temperature",
    "pipeline.dataset.select_rows",
)


def _rules(cfg: ClewConfig) -> list[str]:
    """Every failed rule, as ``[rule] message naming the keys and values``."""
    bad: list[str] = []

    def fail(rule: str, message: str) -> None:
        bad.append(f"[{rule}] {message}")

    # The config's own modules first: they may register the estimators, losses and loggers
    # it names (clew.envs.plugins; a module that fails to import is an EnvError naming it).
    from clew.envs.plugins import import_env_modules

    import_env_modules(cfg.environment.modules)
    gen, tr = cfg.generator, cfg.trainer
    alg, opt, lora = tr.algorithm, tr.policy.optimizer_config, tr.policy.model.lora

    for key in COUNT_KEYS:
        if (value := get_key(cfg, key)) < 1:
            fail("positive-count", f"{key} must be >= 1, got {value}")
    if (k := gen.keep_last_k_images) is not None and k < 1:
        fail("positive-count", f"generator.keep_last_k_images must be >= 1 or null, got {k}")
    from clew.envs.rewards import REWARD_RULES

    if (rule := cfg.environment.reward_rule) not in REWARD_RULES:
        near = difflib.get_close_matches(rule, sorted(REWARD_RULES), n=1)
        fail(
            "reward-rule",
            f"environment.reward_rule {rule!r} is not a reward rule"
            + (f" (did you mean {near[0]!r}?)" if near else "")
            + f"; rules: {', '.join(sorted(REWARD_RULES))}",
        )
    if (fmt := cfg.environment.prompt_format) is not None:
        check_prompt_format(cfg.environment.env_id, fmt, fail)
    if (budget := tr.max_tokens_per_microbatch) < 1 and budget != -1:
        fail(
            "positive-count",
            f"trainer.max_tokens_per_microbatch must be >= 1 tokens, or -1 for micro-batches "
            f"by trajectory count; got {budget}",
        )
    if (chunk := tr.logprobs_chunk_size) is not None and chunk < 1:
        fail(
            "positive-count",
            f"trainer.logprobs_chunk_size must be >= 1 tokens, or null for all at once; "
            f"got {chunk}",
        )
    if tr.flex_attention and tr.device == "cpu":
        fail(
            "flex-attention",
            "trainer.flex_attention=true needs a CUDA device (FlexAttention has no backward "
            "on the CPU); with trainer.device=cpu set it false",
        )
    for key in INTERVAL_KEYS:
        if (value := get_key(cfg, key)) < 1 and value != -1:
            fail("interval", f"{key} must be >= 1, or -1 for never; got {value}")
    if (keep := tr.max_ckpts_to_keep) < 1 and keep != -1:
        fail("max-ckpts", f"trainer.max_ckpts_to_keep must be >= 1, or -1 for all; got {keep}")
    for key in POSITIVE_KEYS:
        if not (value := get_key(cfg, key)) > 0:
            fail("positive", f"{key} must be > 0, got {value}")
    for key in NON_NEGATIVE_KEYS:
        if not (value := get_key(cfg, key)) >= 0:
            fail("non-negative", f"{key} must be >= 0, got {value}")
    if not 0 <= lora.dropout < 1:
        fail(
            "lora-dropout",
            f"trainer.policy.model.lora.dropout must be in [0, 1), got {lora.dropout}",
        )
    if len(opt.adam_betas) != 2 or not all(0 <= b < 1 for b in opt.adam_betas):
        fail(
            "adam-betas",
            "trainer.policy.optimizer_config.adam_betas must be two numbers in [0, 1), "
            f"got {opt.adam_betas}",
        )

    pl = tr.placement
    if pl.num_gpus > 1 and pl.num_cpu_workers > 1:
        fail(
            "one-kind-of-worker",
            f"trainer.placement.num_cpu_workers ({pl.num_cpu_workers}) and "
            f"trainer.placement.policy_num_nodes x policy_num_gpus_per_node ({pl.num_gpus}) "
            "both ask for several workers: set num_cpu_workers on a machine without GPUs, or "
            "the GPU keys, not both",
        )
    if (share := tr.gpu_memory_fraction) is not None:
        if not 0.0 < share <= 1.0:
            fail(
                "gpu-memory-fraction",
                f"trainer.gpu_memory_fraction must be a share of the GPU's memory in (0, 1], "
                f"or null for no cap; got {share}",
            )
        elif pl.num_gpus > 1 or pl.num_cpu_workers > 1:
            fail(
                "gpu-memory-fraction",
                f"trainer.gpu_memory_fraction ({share}) caps a run in one process, but "
                "trainer.placement places several workers on Ray, each on a GPU of its own: "
                "leave it null",
            )
    if pl.num_cpu_workers > 1 and tr.device == "cuda":
        fail(
            "one-kind-of-worker",
            f"trainer.placement.num_cpu_workers ({pl.num_cpu_workers}) places CPU workers, "
            "but trainer.device is cuda: use policy_num_gpus_per_node for GPU workers",
        )

    # Batch arithmetic, checked once the counts are positive. Any mini batch splits over
    # any number of workers (see the module's docstring): the worker count is not in it.
    n, mini = gen.n_samples_per_prompt, tr.policy_mini_batch_size
    micro, traj = tr.micro_train_batch_size_per_gpu, mini * n
    if min(n, mini, micro, tr.train_batch_size) >= 1:
        if tr.train_batch_size % mini:
            fail(
                "batch-divisible",
                f"trainer.train_batch_size ({tr.train_batch_size}) must be a multiple of "
                f"trainer.policy_mini_batch_size ({mini})",
            )
        minibatch = (
            f"a mini batch of {traj} trajectories (trainer.policy_mini_batch_size {mini} x "
            f"generator.n_samples_per_prompt {n})"
        )
        if micro > traj:
            fail(
                "micro-batch-size",
                f"trainer.micro_train_batch_size_per_gpu ({micro}) is more than {minibatch}: "
                f"give at most {traj}",
            )
        elif traj % micro:
            fits = [d for d in range(1, traj + 1) if traj % d == 0]
            fail(
                "micro-batch-divisible",
                f"{minibatch} does not split into micro batches of "
                f"trainer.micro_train_batch_size_per_gpu ({micro}); accepted sizes: "
                f"{', '.join(map(str, fits))}",
            )
    estimator = registered_estimator(alg.advantage_estimator, fail)
    if estimator is not None and n < estimator.min_group_size:
        fail(
            "group-size",
            f"generator.n_samples_per_prompt must be >= {estimator.min_group_size} for "
            f"{alg.advantage_estimator!r}, got {n}: it compares a prompt's samples with each "
            "other, and a smaller group has no reward spread, so every advantage would be zero",
        )
    if alg.advantage_estimator == "pass_at_k":
        pass_at_k_rules(cfg, fail)

    # Sampling and engine.
    for name in ("sampling_params", "eval_sampling_params"):
        sp = getattr(gen, name)
        if sp.temperature < 0:
            fail("temperature", f"generator.{name}.temperature must be >= 0, got {sp.temperature}")
        if not 0 < sp.top_p <= 1:
            fail("top-p", f"generator.{name}.top_p must be in (0, 1], got {sp.top_p}")
        if sp.top_k < 1 and sp.top_k != -1:
            fail("top-k", f"generator.{name}.top_k must be >= 1, or -1 for off; got {sp.top_k}")
        if sp.allowed_tokens is not None and (
            not sp.allowed_tokens or any(not t for t in sp.allowed_tokens)
        ):
            fail(
                "allowed-tokens",
                f"generator.{name}.allowed_tokens must be null or a list of non-empty token "
                f"texts, got {sp.allowed_tokens!r}",
            )
    temperature_schedule_rules(cfg, fail)
    if gen.eval_n_samples_per_prompt > 1 and gen.eval_sampling_params.temperature == 0:
        fail(
            "eval-samples-greedy",
            f"generator.eval_n_samples_per_prompt is {gen.eval_n_samples_per_prompt} but "
            "generator.eval_sampling_params.temperature is 0 (greedy): every sample of a "
            "prompt would be the same; set a temperature > 0 or eval_n_samples_per_prompt=1",
        )
    if not 0 < (gmu := gen.inference_engine.gpu_memory_utilization) <= 1:
        fail(
            "gpu-memory-utilization",
            f"generator.inference_engine.gpu_memory_utilization must be in (0, 1], got {gmu}",
        )

    # Context: the initial prompt plus one full turn must fit in an episode's context.
    turn = max(
        gen.sampling_params.max_generate_length, gen.eval_sampling_params.max_generate_length
    )
    if tr.max_prompt_length + turn > gen.max_input_length:
        fail(
            "context-fits-turn",
            f"trainer.max_prompt_length ({tr.max_prompt_length}) + max_generate_length "
            f"({turn}) = {tr.max_prompt_length + turn} exceeds generator.max_input_length "
            f"({gen.max_input_length}): not even one turn fits",
        )
    mml = gen.inference_engine.max_model_len
    if mml is not None and (not isinstance(mml, int) or isinstance(mml, bool) or mml < 1):
        fail(
            "max-model-len",
            "generator.inference_engine.engine_init_kwargs.max_model_len must be a positive "
            f"integer, got {mml!r}",
        )
    elif mml is not None and mml < gen.max_input_length:
        fail(
            "max-model-len",
            f"generator.max_input_length ({gen.max_input_length}) exceeds the engine's "
            f"max_model_len ({mml})",
        )

    # Algorithm.
    for name in ("eps_clip_low", "eps_clip_high"):
        if not 0 < (eps := getattr(alg, name)) < 1:
            fail("eps-clip", f"trainer.algorithm.{name} must be in (0, 1), got {eps}")
    if (c := alg.clip_ratio_c) is not None and c <= 1:
        fail("clip-ratio-c", f"trainer.algorithm.clip_ratio_c must be > 1 or null, got {c}")
    policy_loss_rules(cfg, fail)
    entropy_floor_rules(cfg, fail)
    if alg.use_tis and alg.tis_imp_ratio_cap <= 0:
        fail(
            "tis-cap",
            "trainer.algorithm.use_tis needs trainer.algorithm.tis_imp_ratio_cap > 0 (e.g. "
            f"2.0), got {alg.tis_imp_ratio_cap}",
        )

    _sft_rules(cfg, fail)
    _engine_rules(cfg, fail)

    # Run management.
    if tr.resume_mode == "from_path" and not tr.resume_path:
        fail("resume-path", "trainer.resume_mode is 'from_path' but trainer.resume_path is unset")
    named_functions(cfg, fail)
    return bad


def _engine_rules(cfg: ClewConfig, fail: Callable[[str, str], None]) -> None:
    """Engine switches that another key turns into a no-op are refused, not ignored."""
    ie = cfg.generator.inference_engine
    key = "generator.inference_engine"
    if ie.decode_attention == "triton" and ie.enforce_eager:
        fail(
            "engine-switch",
            f"{key}.decode_attention=triton is the attention of CUDA-graph steps, and "
            f"{key}.enforce_eager=true takes none: drop one of the two",
        )


def _sft_rules(cfg: ClewConfig, fail: Callable[[str, str], None]) -> None:
    """The ``sft`` section's ranges that the key lists above do not cover."""
    sft = cfg.sft
    if (m := sft.micro_batch_size) is not None and m < 1:
        fail("positive-count", f"sft.micro_batch_size must be >= 1 or null, got {m}")
    for name in ("detour_prob", "start_anywhere"):
        if not 0 <= (share := getattr(sft, name)) <= 1:
            fail("share", f"sft.{name} is a share in [0, 1], got {share}")
    if not 0 < (share := sft.dagger.share) <= 1:
        fail("share", f"sft.dagger.share is a share of each batch in (0, 1], got {share}")
    if (target := sft.stop_at_pass) is not None and not 0 < target <= 1:
        fail("stop-at-pass", f"sft.stop_at_pass is a solve rate in (0, 1] or null, got {target}")
    if (minutes := sft.max_minutes) is not None and not minutes > 0:
        fail("max-minutes", f"sft.max_minutes must be > 0 or null, got {minutes}")
    if not 0 <= sft.lora.dropout < 1:
        fail("lora-dropout", f"sft.lora.dropout must be in [0, 1), got {sft.lora.dropout}")
    betas = sft.optimizer_config.adam_betas
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        fail(
            "adam-betas",
            f"sft.optimizer_config.adam_betas must be two numbers in [0, 1), got {betas}",
        )


def validate(cfg: ClewConfig) -> ClewConfig:
    """Check every rule; raise one ``ConfigError`` listing each failure as ``[rule] message``.

    On success, warn (once per process) about ignored keys that are set, and return ``cfg``.
    """
    bad = _rules(cfg)
    if bad:
        raise ConfigError("invalid configuration: " + "; ".join(bad))
    warn_ignored(cfg)
    return cfg
