"""Configuration of supervised fine-tuning (``sft.*``) and its DAgger rounds."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from clew.config.section import Section
from clew.config.trainer import LoraConfig, OptimizerConfig


class SFTDaggerConfig(Section):
    interval: int = Field(
        0,
        description="DAgger rounds during SFT: every this many SFT steps the policy plays "
        "training rows and the environment's expert labels the states it went wrong in "
        "(clew.trainer.dagger); 0: off.",
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
