"""The typed configuration schema: one pydantic model per component.

Why pydantic with ``extra="forbid"`` and ``strict=True``: a typo or a value of the wrong type
must fail before a run spends GPU hours, with the key named. Key names follow SkyRL wherever
the two share a concept, so a SkyRL launch script maps over by changing only its entry point.
Every field is documented once, here, in ``Field(description=...)``; ``schema_markdown()``
renders these descriptions as the configuration reference. Range and cross-field rules live
in ``validate.py`` so they are checked on the final config, however it was built.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# SkyRL's ``environment.env_class`` names mapped onto clew's env families.
ENV_CLASS_ALIASES: dict[str, str] = {"visgym": "maze_2d"}

# Logger backends ``trainer.logger`` may name.
KNOWN_LOGGERS: tuple[str, ...] = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "ray")


class Section(BaseModel):
    """Base of every config section: unknown keys and wrong types are errors, not coercions."""

    model_config = ConfigDict(extra="forbid", strict=True)


class DataConfig(Section):
    train_data: list[str] = Field(
        default_factory=list,
        description="Parquet files of training prompts (local paths or s3:// URLs).",
    )
    val_data: list[str] = Field(
        default_factory=list,
        description="Parquet files of evaluation prompts; empty disables evaluation.",
    )


class EnvironmentConfig(Section):
    env_class: str = Field(
        "maze_2d",
        description="Environment family. SkyRL's 'visgym' is accepted as an alias for clew's "
        "maze family and is stored as 'maze_2d'.",
    )
    env_id: str = Field(
        "maze_2d/easy",
        description="Environment id used when a dataset row does not carry its own.",
    )
    env_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options passed to every environment constructor.",
    )
    modules: list[str] = Field(
        default_factory=list,
        description="Python modules that register environments (clew.envs.register), imported "
        "before any env is made, in the driver and in every Ray worker: a module of the "
        "current directory or of an installed package. Installed packages can declare a "
        "'clew.envs' entry point instead.",
    )

    @field_validator("env_class")
    @classmethod
    def _resolve_alias(cls, value: str) -> str:
        return ENV_CLASS_ALIASES.get(value, value)


class SamplingParams(Section):
    temperature: float = Field(1.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(
        -1,
        description="Sample from the k most likely tokens; -1 turns it off. "
        "Shapes the draw only (logprobs stay the whole vocabulary's): use allowed_tokens to "
        "restrict replies.",
    )
    max_generate_length: int = Field(
        64, description="Most new tokens generated per turn (SkyRL's name for max_new_tokens)."
    )
    stop: list[str] | None = Field(
        None, description="Strings that end a turn's generation (kept in the output)."
    )
    seed: int | None = Field(None, description="Sampling seed; null derives one from trainer.seed.")
    allowed_tokens: list[str] | None = Field(
        None,
        description="Sample only these tokens (vLLM's allowed_token_ids, by text; each must be "
        "one token of the model's tokenizer, e.g. [up, down, left, right, stop] after "
        "reply_prefix '<action>'): the others are masked before the softmax, so the logprobs "
        "trained on are those of the distribution over the allowed tokens. null: the whole "
        "vocabulary. eval_sampling_params does not inherit it: evaluation reads the policy's "
        "own greedy reply unless set there too.",
    )


class InferenceEngineConfig(Section):
    backend: Literal["clew"] = Field(
        "clew", description="Inference engine; clew's in-process engine is the only one."
    )
    num_engines: int = Field(1, description="SkyRL: number of inference engines.")
    tensor_parallel_size: int = Field(1, description="SkyRL: GPUs per inference engine.")
    gpu_memory_utilization: float = Field(
        0.45,
        description="On GPU, the share of device memory the KV cache may take, in (0, 1].",
    )
    max_cache_mb: int = Field(4096, description="On CPU, the memory budget of the KV cache in MiB.")
    kv_cache: Literal["static", "dynamic"] = Field(
        "static",
        description="The engine's KV cache: 'static' writes each row's keys in place into "
        "preallocated slots and attends over each row's live part with grouped-query SDPA "
        "(its budget counts rows by their real lengths); 'dynamic' is transformers' "
        "DynamicCache (concatenated every forward, rows padded to one width), the reference.",
    )
    engine_init_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="SkyRL engine options; clew reads `max_model_len` (the engine's context "
        "limit in tokens) when present.",
    )

    @property
    def max_model_len(self) -> int | None:
        """The engine context limit from ``engine_init_kwargs``, if given."""
        return self.engine_init_kwargs.get("max_model_len")


class GeneratorConfig(Section):
    n_samples_per_prompt: int = Field(
        8, description="Trajectories sampled per prompt; one GRPO group. At least 2."
    )
    eval_n_samples_per_prompt: int = Field(
        1,
        description="Trajectories sampled per evaluation prompt; above 1 (with "
        "eval_sampling_params.temperature > 0) eval/all/pass_at_<n> is reported beside pass_at_1.",
    )
    max_turns: int = Field(20, description="Most agent turns in one episode.")
    max_input_length: int = Field(
        8192,
        description="Most tokens of context per episode (prompt, observations and all turns); "
        "an episode that would exceed it is truncated.",
    )
    keep_last_k_images: int | None = Field(
        None,
        description="Keep only the k most recent images in the context (older ones are "
        "dropped); null keeps all.",
    )
    reply_prefix: str = Field(
        "",
        description="Text written at the start of every reply before sampling (e.g. "
        "'<action>'), as structured-output decoding fixes a reply's format: context, not "
        "action (no loss, no logprob). '' samples the whole reply.",
    )
    reply_suffix: str = Field(
        "",
        description="Text written after a reply that ran to max_generate_length (e.g. "
        "'</action>'), before <|im_end|>; the env reads prefix + sampled text + suffix.",
    )
    batched: bool = Field(False, description="SkyRL: batched single-turn generation.")
    vision_language_generator: bool = Field(
        True, description="SkyRL: use the vision-language generator."
    )
    sampling_params: SamplingParams = Field(
        default_factory=SamplingParams, description="Sampling for training rollouts."
    )
    eval_sampling_params: SamplingParams = Field(
        default_factory=SamplingParams,
        description="Sampling for evaluation rollouts. Keys not set here are greedy "
        "(temperature 0) and take max_generate_length and stop from sampling_params.",
    )
    inference_engine: InferenceEngineConfig = Field(
        default_factory=InferenceEngineConfig,
        description="The engine that generates rollouts.",
    )

    @model_validator(mode="after")
    def _eval_defaults(self) -> GeneratorConfig:
        ev, given = self.eval_sampling_params, self.eval_sampling_params.model_fields_set
        if "temperature" not in given:
            ev.temperature = 0.0
        for name in ("max_generate_length", "stop"):
            if name not in given:
                setattr(ev, name, getattr(self.sampling_params, name))
        return self


class DynamicSamplingConfig(Section):
    type: Literal["filter"] | None = Field(
        None,
        description="DAPO's dynamic sampling: 'filter' plays more batches of prompts until "
        "train_batch_size groups with reward spread are in hand and updates on those only "
        "(train/* rollout metrics still cover every episode played); null: off.",
    )
    max_sample_batches: int = Field(
        30,
        description="Most batches of train_batch_size prompts played for one step under "
        "'filter'; at the limit (or when the data runs out) the step updates on the groups "
        "with spread found so far instead of failing. 0 or less: no limit.",
    )


class GigpoConfig(Section):
    gamma: float = Field(
        0.95,
        gt=0.0,
        le=1.0,
        description="Discount of the per-turn returns that GiGPO's step groups compare, in "
        "(0, 1]: below 1, reaching the goal in fewer turns from a state is better.",
    )
    step_advantage_w: float = Field(
        1.0,
        ge=0.0,
        description="Weight of the step-level advantage added to the episode-level one "
        "(0: every turn gets its episode's GRPO advantage).",
    )


class AlgorithmConfig(Section):
    advantage_estimator: str = Field(
        "grpo",
        description="How advantages are computed within a group, by registered name: 'grpo' "
        "(reward minus group mean), 'rloo' (reward minus the mean of the others), 'gigpo' "
        "(GRPO per episode plus a per-turn advantage among the group's turns taken from the "
        "same state; clew.algorithms.step_advantages), or one registered with "
        "clew.algorithms.register_estimator before the config is loaded.",
    )
    gigpo: GigpoConfig = Field(
        default_factory=GigpoConfig,
        description="Settings of the 'gigpo' estimator (unused by the others).",
    )
    norm_adv_by_std_in_grpo: bool = Field(
        True, description="Divide GRPO advantages by the group's reward standard deviation."
    )
    turn_discount: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Each episode's reward is multiplied by turn_discount ** (turns - 1) "
        "before advantages (and dynamic sampling's spread test), so a solve in fewer turns "
        "ranks above a longer one and groups where every sample solved keep a signal; 1 "
        "leaves rewards as the env gave them. Rollout and eval metrics use the env's reward.",
    )
    drop_zero_spread_groups: bool = Field(
        False,
        description="Leave groups whose rewards are all equal out of the loss (they carry no "
        "signal).",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig,
        description="Sampling more prompts so every update is made of groups with signal.",
    )
    use_kl_loss: bool = Field(
        False, description="Add a KL penalty to the reference (initial) policy to the loss."
    )
    kl_loss_coef: float = Field(0.001, description="Weight of the KL penalty.")
    kl_estimator_type: Literal["k1", "k3"] = Field(
        "k3", description="KL estimator: 'k1' (log-ratio) or 'k3' (low-variance, non-negative)."
    )
    policy_loss_type: Literal["regular"] = Field(
        "regular", description="Policy loss; 'regular' is the PPO clipped objective."
    )
    eps_clip_low: float = Field(0.2, description="PPO ratio clip below 1, in (0, 1).")
    eps_clip_high: float = Field(0.2, description="PPO ratio clip above 1, in (0, 1).")
    clip_ratio_c: float | None = Field(
        None,
        description="Dual-clip bound (> 1) on the ratio for negative advantages; null is off.",
    )
    loss_reduction: Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="How per-token losses become one number: mean over all tokens, mean of "
        "per-sequence means, or per-sequence sums divided by a fixed length.",
    )
    use_entropy_loss: bool = Field(False, description="Add an entropy bonus to the loss.")
    entropy_loss_coef: float = Field(0.01, description="Weight of the entropy bonus.")
    recompute_old_logprobs: bool = Field(
        False,
        description="Score each batch with the trainer's own forward before the update and "
        "use those logprobs as PPO's old policy instead of the engine's sampling logprobs (what "
        "SkyRL and verl always do): one more forward pass over the batch, in micro batches of "
        "micro_forward_batch_size_per_gpu. Every step logs policy/logprob_diff_* (engine "
        "against trainer) either way.",
    )
    use_tis: bool = Field(
        False,
        description="Truncated importance sampling (SkyRL's key): each token's policy loss is "
        "multiplied by min(exp(trainer - engine logprob), tis_imp_ratio_cap), correcting for "
        "the engine sampling from a slightly different distribution than the trainer scores; "
        "implies recompute_old_logprobs.",
    )
    tis_imp_ratio_cap: float = Field(
        -1.0,
        description="Upper bound of the TIS weights; must be > 0 when use_tis is on (e.g. 2.0).",
    )


class LoraConfig(Section):
    rank: int = Field(0, description="LoRA rank; 0 trains all weights (full fine-tuning).")
    alpha: float = Field(16.0, description="LoRA scaling numerator (scale = alpha / rank).")
    dropout: float = Field(0.0, description="Dropout on the LoRA input, in [0, 1).")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Modules that get adapters: 'all-linear' (every linear layer of the "
        "language model), 'vision_and_language' (the vision tower's and mergers' too), a peft "
        "regex over module names, or a list of module names.",
    )
    lora_sync_path: str | None = Field(
        None, description="SkyRL: directory where adapters are handed to the inference engine."
    )


class ModelConfig(Section):
    path: str | None = Field(
        None, description="Hugging Face model id or local/s3 directory of the policy."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Low-rank adapters.")


class OptimizerConfig(Section):
    lr: float = Field(1e-6, description="AdamW learning rate.")
    adam_betas: list[float] = Field(
        default_factory=lambda: [0.9, 0.999], description="AdamW (beta1, beta2)."
    )
    weight_decay: float = Field(0.01, description="AdamW decoupled weight decay.")
    max_grad_norm: float = Field(1.0, description="Clip the gradient's global norm to this.")
    num_warmup_steps: int = Field(0, description="Optimizer steps of linear learning-rate warmup.")
    scheduler: Literal["constant_with_warmup", "cosine", "linear"] = Field(
        "constant_with_warmup", description="Learning-rate schedule after warmup."
    )


class FsdpConfig(Section):
    cpu_offload: bool = Field(False, description="SkyRL: offload FSDP parameters to CPU.")


class PolicyConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    optimizer_config: OptimizerConfig = Field(
        default_factory=OptimizerConfig, description="The policy optimizer."
    )
    fsdp_config: FsdpConfig = Field(
        default_factory=FsdpConfig, description="SkyRL FSDP options for the policy."
    )


class RefConfig(Section):
    fsdp_config: FsdpConfig = Field(
        default_factory=FsdpConfig, description="SkyRL FSDP options for the reference model."
    )


class PlacementConfig(Section):
    colocate_all: bool = Field(True, description="Run generation and training on the same GPUs.")
    policy_num_nodes: int = Field(
        1,
        description="Nodes that train the policy, one Ray worker per GPU through a placement "
        "group when there is more than one GPU in all.",
    )
    policy_num_gpus_per_node: int = Field(
        1,
        description="GPUs per node that train the policy; GPUs the cluster does not have are "
        "refused at launch.",
    )
    num_cpu_workers: int = Field(
        1,
        description="On a machine without GPUs, the number of CPU workers (Ray actors on an "
        "embedded or joined Ray) for laptops and tests; 1 runs in the driver's process.",
    )
    timeout_s: float = Field(
        120.0,
        gt=0,
        description="Seconds to wait for Ray to place the workers (one bundle each) before "
        "failing with what was asked and what the cluster has free.",
    )
    ref_num_nodes: int = Field(1, description="SkyRL: nodes for the reference model.")
    ref_num_gpus_per_node: int = Field(1, description="SkyRL: GPUs per node for the reference.")

    @property
    def num_gpus(self) -> int:
        """Policy training processes in total (one per GPU)."""
        return self.policy_num_nodes * self.policy_num_gpus_per_node

    @property
    def num_workers(self) -> int:
        """Data-parallel policy workers: one per GPU, or the CPU workers."""
        return max(self.num_gpus, self.num_cpu_workers)


class TrainerConfig(Section):
    strategy: Literal["fsdp", "ddp", "none", "fsdp2"] = Field(
        "fsdp",
        description=(
            "How several policy workers share the model. 'fsdp' (or 'fsdp2', the same) "
            "shards a fully fine-tuned policy with FSDP2: each worker holds a share of the "
            "weights, gradients and optimizer state, and gathers the whole weights while it "
            "samples. With LoRA the frozen base stays whole on every worker and only the "
            "adapter's gradients travel, whatever the strategy; 'ddp' and 'none' keep a "
            "whole copy on every worker; one worker ignores it."
        ),
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where to train: 'auto' uses CUDA when available."
    )
    bf16: bool = Field(
        True,
        description="Mixed precision on CUDA: bfloat16 compute over float32 weights (a frozen LoRA base loads in bfloat16); float32 elsewhere or when false.",
    )
    seed: int = Field(42, description="Seed for data order, sampling and initialisation.")
    epochs: int = Field(1, description="Passes over the training prompts.")
    max_steps: int = Field(
        -1, description="Stop after this many training steps in all; -1 runs every epoch."
    )
    train_batch_size: int = Field(
        16, description="Prompts per training step (each sampled n_samples_per_prompt times)."
    )
    policy_mini_batch_size: int = Field(
        8,
        description="Prompts per optimizer step; a step's batch is split into "
        "train_batch_size / policy_mini_batch_size updates.",
    )
    micro_forward_batch_size_per_gpu: int = Field(
        1, description="Trajectories per GPU per forward pass when scoring log-probs."
    )
    micro_train_batch_size_per_gpu: int = Field(
        1, description="Trajectories per GPU per forward/backward pass (gradient accumulation)."
    )
    update_epochs_per_batch: int = Field(
        1, description="Passes of policy updates over each training batch."
    )
    max_prompt_length: int = Field(
        512, description="Most tokens of the initial prompt (system, task and first image)."
    )
    remove_microbatch_padding: bool = Field(
        False,
        description="Lay each micro-batch's trajectories end to end in one row with no "
        "padding, each attending only to itself (one causal attention call per length, no "
        "block-diagonal mask), in the update and in log-prob scoring alike; the same loss and "
        "gradients as padded micro-batches. SkyRL defaults it to true.",
    )
    max_tokens_per_microbatch: int = Field(
        -1,
        description="When > 0, micro-batches (of the update and of log-prob scoring) hold "
        "as many trajectories, sorted by length, as fit this many tokens (padding counted, "
        "or with remove_microbatch_padding the trajectories' own), and "
        "micro_train_batch_size_per_gpu / micro_forward_batch_size_per_gpu are ignored; a "
        "trajectory longer than it gets a micro-batch of its own. Each micro-batch's loss is "
        "weighted by its share of the mini-batch, so the grouping does not change the "
        "update. -1: off.",
    )
    logprobs_chunk_size: int | None = Field(
        None,
        description="Compute training's log-probs and entropies (GRPO and SFT) from the "
        "language model's last hidden states this many tokens at a time through the output "
        "projection, recomputing each chunk in backward, so the [tokens, vocabulary] "
        "logits never exist whole (with a 151,936-entry vocabulary they outgrow the model); "
        "null: all at once. SkyRL defaults it to 1024.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in backward instead of "
        "keeping them (GRPO and SFT): less memory for about a third more compute. SkyRL "
        "defaults it to true.",
    )
    eval_interval: int = Field(
        5,
        description="Evaluate every this many steps, and at the last step when the run ends "
        "on max_steps or the data (not on a SIGINT/SIGTERM); -1 never.",
    )
    eval_before_train: bool = Field(True, description="Evaluate once before the first step.")
    ckpt_interval: int = Field(
        10,
        description="Checkpoint every this many steps and at the step the run ends on "
        "(max_steps, the data, or a SIGINT/SIGTERM); -1 never.",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Times a run whose Ray worker died (actor killed, process crashed, node "
        "gone) rebuilds its worker group and goes on from the latest checkpoint (step 0 if "
        "none yet) before it fails; an error in the training code itself is never retried.",
    )
    hf_save_interval: int = Field(
        -1, description="Export a Hugging Face model every this many steps; -1 never."
    )
    export_best: bool = Field(
        True,
        description="After an evaluation whose eval/all/pass_at_1 beats every earlier one of "
        "the run (the one before training included), export the policy to "
        "export_path/best/policy, with best.json naming its step and value.",
    )
    max_ckpts_to_keep: int = Field(
        -1, description="Checkpoints kept on disk, oldest deleted first; -1 keeps all."
    )
    logger: str | list[str] = Field(
        "console",
        description="Metric sink(s): one or a list of "
        + ", ".join(KNOWN_LOGGERS)
        + ". jsonl (RUN_DIR/metrics.jsonl) is always on, and ray (Ray's metrics API, scraped "
        "by Prometheus) whenever the run uses Ray: more than one policy worker, or RAY_ADDRESS "
        "set.",
    )
    project_name: str = Field("clew", description="Project name for loggers.")
    run_name: str = Field("clew_run", description="Run name for loggers and output folders.")
    resume_mode: Literal["none", "latest", "from_path"] = Field(
        "latest",
        description="'latest' resumes from the newest checkpoint under ckpt_path if there is "
        "one, 'from_path' from resume_path, 'none' starts fresh.",
    )
    resume_path: str | None = Field(
        None, description="Checkpoint to resume from when resume_mode is 'from_path'."
    )
    log_path: str = Field("/tmp/clew-logs", description="Directory for local logs.")
    dump_eval_results: bool = Field(
        True, description="Write every evaluation's trajectories and rewards to disk."
    )
    export_path: str | None = Field(
        None,
        description="Directory (local or s3://) for exported adapters/models and eval dumps; "
        "null is RUN_DIR/exports (RUN_DIR = log_path/run_name).",
    )
    ckpt_path: str | None = Field(
        None,
        description="Directory (local or s3://) for full training checkpoints; null is "
        "RUN_DIR/ckpts.",
    )
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="The RL objective."
    )
    policy: PolicyConfig = Field(
        default_factory=PolicyConfig, description="The trained policy: model and optimizer."
    )
    ref: RefConfig = Field(
        default_factory=RefConfig, description="SkyRL: the reference model's own options."
    )
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig, description="Where the policy runs."
    )

    @field_validator("resume_mode", mode="before")
    @classmethod
    def _null_is_none(cls, value: Any) -> Any:
        return "none" if value is None else value

    @property
    def logger_names(self) -> list[str]:
        """``logger`` as a list."""
        return [self.logger] if isinstance(self.logger, str) else list(self.logger)


class SFTDaggerConfig(Section):
    interval: int = Field(
        0,
        description="DAgger rounds during SFT: every this many SFT steps the policy plays "
        "training rows and the environment's expert labels the states it went wrong in "
        "(clew.train.dagger); 0: off.",
    )
    rows: int = Field(64, description="Training rows the policy plays in each DAgger round.")
    share: float = Field(
        0.5,
        description="Share of every SFT batch drawn from the rounds' branch demonstrations, "
        "in (0, 1].",
    )
    keep_rounds: int = Field(
        1,
        description="Rounds whose branch demonstrations the batches draw from, the latest "
        "first; 0: every round (DAgger's dataset aggregation, 1-2 MB of frames a "
        "demonstration).",
    )
    temperature: float = Field(
        1.0, description="The policy's sampling temperature in DAgger rounds; 0 is greedy."
    )


def _described(model: type[BaseModel], name: str, default: Any) -> Any:
    """``name``'s field of ``model`` with another default, its description kept in one place."""
    return Field(default, description=model.model_fields[name].description)


class SFTOptimizerConfig(OptimizerConfig):
    """AdamW as for GRPO, with defaults for SFT from scratch (a much larger rate, a warmup)."""

    lr: float = _described(OptimizerConfig, "lr", 1e-3)
    weight_decay: float = _described(OptimizerConfig, "weight_decay", 0.0)
    num_warmup_steps: int = _described(OptimizerConfig, "num_warmup_steps", 20)


class SFTConfig(Section):
    model_path: str | None = Field(
        None,
        description="Starting checkpoint: a local Hugging Face directory (`clew init-model` "
        "output or any Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint). Required by `clew sft`.",
    )
    run_name: str = Field(
        "sft", description="Run folder of the SFT stage: trainer.log_path/sft.run_name."
    )
    steps: int = Field(300, description="Optimizer steps of SFT.")
    batch_size: int = Field(16, description="Expert episodes per optimizer step.")
    micro_batch_size: int | None = Field(
        None,
        description="Episodes per forward/backward pass (rows when pack_sequences); null is "
        "batch_size.",
    )
    pack_sequences: bool = Field(
        False,
        description="Lay short episodes end to end in rows: the same loss with less padding.",
    )
    optimizer_config: SFTOptimizerConfig = Field(
        default_factory=SFTOptimizerConfig,
        description="The SFT optimizer (AdamW); cosine and linear schedules decay to 0 at "
        "sft.steps.",
    )
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="Low-rank adapters for SFT (rank 0 trains all weights); the exported "
        "policy has them merged into full weights.",
    )
    precision: Literal["bf16-mixed", "bf16-true", "32-true"] = Field(
        "bf16-mixed",
        description="On CUDA: float32 weights with bfloat16 compute (bf16-mixed), bfloat16 "
        "weights (bf16-true) or float32 (32-true); float32 on CPU.",
    )
    seed: int = Field(0, description="Seed of the demonstrations' order, detours and DAgger.")
    detour_prob: float = Field(
        0.0,
        description="Share of demonstration turns that take a wrong move on purpose (out of "
        "the loss) from which the expert recovers, in [0, 1].",
    )
    start_anywhere: float = Field(
        0.0,
        description="Share of demonstrations that start on a random cell the expert can "
        "still finish from, in [0, 1] (environments that offer start cells).",
    )
    eval_interval: int = Field(
        -1,
        description="Evaluate greedy pass@1 on data.val_data every this many steps, and "
        "after the last step whenever val_data is given; -1: only after the last step.",
    )
    stop_at_pass: float | None = Field(
        None,
        description="End SFT (exported as after the last step) at the first evaluation whose "
        "eval/all/pass_at_1 reaches this, in (0, 1]: a GRPO start meant to lie in a band "
        "of solve rates stops inside it. Needs data.val_data.",
    )
    max_minutes: float | None = Field(
        None,
        description="End SFT (evaluated and exported) at the first step that finishes past "
        "this wall-clock budget; null: no budget.",
    )
    ckpt_interval: int = Field(
        50,
        description="Full checkpoint (weights, optimizer, data position, DAgger pool, RNG) in "
        "RUN_DIR/ckpts every this many steps and at the step the run ends on, for "
        "trainer.resume_mode=latest; -1 never.",
    )
    hf_save_interval: int = Field(
        -1,
        description="Also export the policy every this many steps to "
        "export_path/global_step_N/policy; -1 never.",
    )
    export_best: bool = Field(
        False,
        description="Keep the best evaluation's policy in export_path/best/policy with "
        "best.json naming its step (needs data.val_data).",
    )
    export_path: str | None = Field(
        None,
        description="Directory (local or s3://) for the SFT exports; the final policy (full "
        "weights, LoRA merged) is export_path/final/policy. null is RUN_DIR/exports.",
    )
    dagger: SFTDaggerConfig = Field(
        default_factory=SFTDaggerConfig, description="DAgger rounds during SFT."
    )


class PipelineDatasetConfig(Section):
    env_id: str = Field("maze_2d/easy", description="Environment id of the generated rows.")
    env_options: dict[str, Any] = Field(
        default_factory=dict, description="Options of the environment (as `clew dataset --option`)."
    )
    train_rows: int = Field(2048, description="Training rows generated.")
    eval_rows: int = Field(64, description="Evaluation rows generated (distinct layouts).")


class PipelineModelConfig(Section):
    preset: str = Field("tiny", description="Model preset of `clew init-model`.")
    arch: Literal["qwen2_vl", "qwen3_vl"] = Field("qwen3_vl", description="Architecture.")
    image_size: int | None = Field(
        None, description="Largest image side in px; null: the environment's frame side."
    )
    patch_size: int | None = Field(
        None, description="Vision patch in px; null: the architecture's own."
    )
    merge_size: int = Field(2, description="Vision patches merged per side into one token.")
    image_mean: list[float] | None = Field(
        None, description="Pixel normalization mean per channel; null: the architecture's."
    )
    image_std: list[float] | None = Field(
        None, description="Pixel normalization std per channel; null: the architecture's."
    )
    position_table: Literal["sincos", "centered"] = Field(
        "sincos", description="Qwen3-VL vision position table at start."
    )
    text: dict[str, Any] = Field(
        default_factory=dict, description="Language-model fields replaced (as --text K=V)."
    )
    vision: dict[str, Any] = Field(
        default_factory=dict, description="Vision-tower fields replaced (as --vision K=V)."
    )
    seed: int = Field(0, description="Seed of the random initial weights.")


class PipelineConfig(Section):
    stages: list[Literal["dataset", "model", "sft", "train"]] = Field(
        default_factory=lambda: ["dataset", "model", "sft", "train"],
        description="Stages `clew pipeline` runs, in this order, under trainer.log_path: "
        "'dataset' writes data/{train,eval}.parquet and sets data.train_data/val_data; "
        "'model' builds models/base offline and sets sft.model_path; 'sft' runs `clew sft` "
        "and sets trainer.policy.model.path to its final policy; 'train' runs GRPO.",
    )
    dataset: PipelineDatasetConfig = Field(
        default_factory=PipelineDatasetConfig, description="The 'dataset' stage."
    )
    model: PipelineModelConfig = Field(
        default_factory=PipelineModelConfig, description="The 'model' stage."
    )


class ClewConfig(Section):
    """The whole configuration of a clew run; saved as ``config.yaml`` in every run folder."""

    data: DataConfig = Field(default_factory=DataConfig, description="Prompt datasets.")
    environment: EnvironmentConfig = Field(
        default_factory=EnvironmentConfig, description="The environments the agent acts in."
    )
    generator: GeneratorConfig = Field(
        default_factory=GeneratorConfig, description="Multi-turn rollout generation."
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The training loop.")
    sft: SFTConfig = Field(
        default_factory=SFTConfig,
        description="Supervised fine-tuning on expert demonstrations (`clew sft`); it also "
        "reads data.*, generator.keep_last_k_images and trainer.log_path, logger, "
        "project_name, resume_mode, resume_path, device and max_ckpts_to_keep.",
    )
    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig,
        description="A recipe's chain of stages (`clew pipeline`).",
    )
