"""Configuration of the training loop (``trainer.*``): policy, optimizer, placement, logging."""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import Field, field_validator

from clew.config.algorithm import AlgorithmConfig
from clew.config.section import Section
from clew.errors import ConfigError

# SkyRL's placement-group timeout variable, read when trainer.placement.timeout_s is unset.
PG_TIMEOUT_VAR = "SKYRL_RAY_PG_TIMEOUT_IN_S"
DEFAULT_PG_TIMEOUT_S = 120.0

# Logger backends ``trainer.logger`` may name.
KNOWN_LOGGERS: tuple[str, ...] = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "ray")


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
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="Seconds to wait for Ray to place the workers (one bundle each) before "
        "failing with what was asked and what the cluster has free. null: SkyRL's "
        f"{PG_TIMEOUT_VAR} environment variable when it is set, else "
        f"{DEFAULT_PG_TIMEOUT_S:g}; a value set here wins over the variable.",
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

    def placement_timeout(self) -> tuple[float, str]:
        """Seconds to wait for the workers' placement group, and where that number came
        from: ``timeout_s`` when set, else ``SKYRL_RAY_PG_TIMEOUT_IN_S`` (SkyRL's variable,
        600 in the walkthrough's train_job.sh) when set, else 120. A variable that is not
        a positive number of seconds is a ``ConfigError`` naming it."""
        if self.timeout_s is not None:
            return float(self.timeout_s), "trainer.placement.timeout_s"
        raw = os.environ.get(PG_TIMEOUT_VAR, "").strip()
        if not raw:
            return DEFAULT_PG_TIMEOUT_S, "trainer.placement.timeout_s (default)"
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(
                f"{PG_TIMEOUT_VAR}={raw!r} is not a placement timeout: give a positive number "
                "of seconds (e.g. 600), unset it, or set trainer.placement.timeout_s, which "
                "wins over it"
            )
        return value, f"{PG_TIMEOUT_VAR} (trainer.placement.timeout_s unset)"


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
    gpu_memory_fraction: float | None = Field(
        None,
        description="The share of the GPU's memory, in (0, 1], that a run in one process may "
        "hold (torch.cuda.set_per_process_memory_fraction): its caching allocator gives cached "
        "blocks back before going past it, and the KV cache's share "
        "(generator.inference_engine.gpu_memory_utilization) is held under it. For runs that "
        "share a GPU: `clew train -m --jobs N` sets 1/N in each run it starts unless this is "
        "set. null: no cap. Not with several workers placed on Ray (each has a GPU of its own).",
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
    flex_attention: bool = Field(
        False,
        description="Attend every training forward's language layers (GRPO's update and "
        "logprobs, SFT) through FlexAttention, compiled, under a block mask computed from the "
        "batch's visibility (causal, old images hidden, packed sequences apart), so blocks "
        "no query sees are skipped and no [W, W] mask is built. CUDA only. The same loss "
        "and gradients (clew.models.packed_attention).",
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
        description="After an evaluation whose picking figure beats every earlier one of the "
        "run (the one before training included), export the policy to "
        "export_path/best/policy, with best.json naming its step, the metric that picked and "
        "its value. The picking figure is select/all/pass_at_1 when data.select_data is set, "
        "else eval/all/pass_at_1.",
    )
    max_ckpts_to_keep: int = Field(
        -1, description="Checkpoints kept on disk, oldest deleted first; -1 keeps all."
    )
    logger: str | list[str] = Field(
        "console",
        description="Metric sink(s): one or a list of "
        + ", ".join(KNOWN_LOGGERS)
        + ", or a logger registered with clew.metrics.register_logger (in a module of "
        "environment.modules). jsonl (RUN_DIR/metrics.jsonl) is always on, and ray (Ray's "
        "metrics API, scraped by Prometheus) whenever the run uses Ray: more than one policy "
        "worker, or RAY_ADDRESS set.",
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
