"""Configuration of rollout generation (``generator.*``): sampling and the inference engine."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from clew.config.section import Section


class SamplingParams(Section):
    temperature: float = Field(1.0, description="Sampling temperature; 0 is greedy.")
    temperature_end: float | None = Field(
        None,
        description="Training rollouts (sampling_params only; null under "
        "eval_sampling_params): the temperature of the last training step, > 0, reached "
        "linearly from temperature (> 0) at step 1; null keeps temperature throughout. The "
        "last step is the one the learning-rate schedule ends at: trainer.max_steps, or the "
        "data's steps (rows // train_batch_size x epochs) if fewer. The update scores each "
        "step's tokens at that step's temperature; train/temperature logs it. Lowering it "
        "sharpens the rollouts as the policy improves, raising it samples more widely; a "
        "higher rollout temperature slows entropy collapse (Skywork-OR1, "
        "https://arxiv.org/abs/2505.22312).",
    )
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
    enforce_eager: bool = Field(
        False,
        description="SkyRL/vLLM: true runs every decode step eagerly (to rule CUDA graphs out "
        "while debugging). false (the default) replays decode steps from CUDA graphs on a GPU, "
        "captured per batch shape (rows rounded up, attention width rounded up to 256 "
        "columns), for rows without per-row adapters; no effect on a CPU.",
    )
    decode_attention: Literal["auto", "sdpa", "varlen", "triton"] = Field(
        "auto",
        description="The attention of CUDA-graph decode steps: 'auto' (the default) is "
        "'triton' on a CUDA device where the triton package is installed (torch's CUDA builds "
        "bring it), else 'varlen'. 'triton' reads each row's own columns through clew's "
        "split-KV Triton kernel (clew.kernels.split_decode; Triton's interpreter on a CPU), "
        "each KV head read once for its query heads, so less KV traffic than 'varlen' and "
        "measured faster at Qwen3-VL-8B's shape (BENCHMARKS.md, "
        "benchmarks/decode_attention.py). 'varlen' is torch's variable-length "
        "memory-efficient kernel reading each row's own columns, one graph per row count "
        "(for a device or build without triton). 'sdpa' reads every row's keys to the "
        "longest row's width (rounded up to 256): the plain reference, for debugging. Steps "
        "while images are hidden use 'sdpa'.",
    )
    prefill_attention: Literal["auto", "sdpa", "varlen", "triton"] = Field(
        "auto",
        description="The attention of a turn's prefill: 'auto' (the default) is 'triton' on "
        "a CUDA device where the triton package is installed, else 'varlen'. 'triton' reads "
        "each row's own columns, causally, through clew's Triton kernel, which packs the "
        "query heads of each KV head into one block of queries "
        "(clew.kernels.prefill_triton; Triton's interpreter on a CPU), so each KV block is "
        "read once for all its query heads; measured faster than 'varlen' at many-turn "
        "widths (BENCHMARKS.md, benchmarks/prefill_attention.py). 'varlen' reads the same "
        "columns through FlashAttention's variable-length kernel on a GPU that runs it "
        "(bf16 or fp16, Ampere on; masked SDPA over the same layout elsewhere). On a GPU, "
        "with either, a turn's prefill runs the rows' new tokens alone, one row after "
        "another in one sequence, instead of left-padded to the longest chunk (rows with "
        "per-row adapters stay padded). 'sdpa' is SDPA under a mask over every row's keys "
        "to the longest row's width, padded: the plain reference, for debugging. All take "
        "the masked, padded prefill while images are hidden.",
    )
    fused_pointwise: bool = Field(
        True,
        description="The rotary embeddings (language model and vision tower) and the SwiGLU "
        "gate as one torch.compile'd kernel each in the engine's forwards on a GPU (about "
        "ten element-wise kernels a layer fewer in a decode step; decode steps run eagerly "
        "leave them out, as their host cost outweighs them there); compiled on first use, in "
        "a CUDA-graph step's warm-up (a failed compilation warns and stays eager). Measured "
        "faster in a many-turn Qwen3-VL-8B rollout (BENCHMARKS.md). No effect on a CPU or in "
        "the trainer's forwards.",
    )
    prefill_cuda_graphs: bool = Field(
        False,
        description="true replays each turn's prefill (the language model's layers) from CUDA "
        "graphs on a GPU, captured per shape (rows rounded up, the chunk's width, attention "
        "width rounded up to 256 columns) for a whole batch without per-row adapters, which "
        "then takes the padded prefill, and keeps the KV cache's buffers "
        "between batches so later GRPO steps replay the graphs earlier ones captured "
        "(clew.inference.prefill_graphs). For small policies, whose turns are bound by "
        "kernel launches (BENCHMARKS.md, 'The small-model regime'); the buffers and graphs "
        "then hold device memory through the policy update. Off with enforce_eager; no "
        "effect on a CPU.",
    )
    vision_cuda_graphs: bool = Field(
        False,
        description="true replays each turn's vision tower from CUDA graphs on a GPU, captured "
        "per number of distinct frames (rounded up: 1, 2, 4, 8, then multiples of 16) and "
        "frame size, its positions worked out once per shape (clew.inference.vision_graphs). "
        "For small policies, whose turns are bound by kernel launches; a tower whose output "
        "differs from its own forward's turns the graphs off with a warning. Off with "
        "enforce_eager; no effect on a CPU.",
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
    env_workers: int = Field(
        0,
        ge=0,
        description="Threads that step the envs and encode their observations between two "
        "turns; 0: one per CPU core, at most 8; 1: in the rollout loop's own thread (for envs "
        "whose instances share mutable state).",
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
