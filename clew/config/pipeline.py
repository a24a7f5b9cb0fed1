"""Configuration of a recipe's chain of stages (``pipeline.*``, `clew pipeline`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from clew.config.section import Section


class PipelineDatasetConfig(Section):
    env_id: str = Field("maze_2d/easy", description="Environment id of the generated rows.")
    env_options: dict[str, Any] = Field(
        default_factory=dict, description="Options of the environment (as `clew dataset --option`)."
    )
    eval_env_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the evaluation rows' environment, over env_options (e.g. "
        "{layout: visgym_easy_eval}: VisGym's own 64 eval mazes, the walkthrough's eval set).",
    )
    train_rows: int = Field(2048, description="Training rows generated.")
    eval_rows: int = Field(64, description="Evaluation rows generated (distinct layouts).")
    select_rows: int = Field(
        0,
        description="Selection rows generated into data/select.parquet, which becomes "
        "data.select_data (GRPO's best policy is picked on them, not on the eval set): "
        "eval-split rows of the eval options, each a distinct task that is none of the eval "
        "set's; the 'test' stage's held-out rows exclude their tasks too. 0: none, and "
        "data.select_data is left as given.",
    )
    select_seed_start: int = Field(
        3_000_000_000,
        description="First seed of the selection rows' walk (the eval set's starts at "
        "1,000,000,000, the held-out set's at pipeline.test.seed_start).",
    )


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


class PipelineTestConfig(Section):
    rows: int = Field(
        1024,
        description="Held-out rows generated: eval-split rows of the 'dataset' stage's env id "
        "and eval options (env_options | eval_env_options), each a distinct task that is none "
        "of the eval set's (data.val_data) or the selection set's (data.select_data).",
    )
    seed_start: int = Field(
        2_000_000_000,
        description="First seed of the held-out rows' walk (the eval set's starts at "
        "1,000,000,000, the selection set's at pipeline.dataset.select_seed_start).",
    )


class PipelineConfig(Section):
    stages: list[Literal["dataset", "model", "sft", "train", "test"]] = Field(
        default_factory=lambda: ["dataset", "model", "sft", "train"],
        description="Stages `clew pipeline` runs, in this order, under trainer.log_path: "
        "'dataset' writes data/{train,eval}.parquet and sets data.train_data/val_data (and "
        "data/select.parquet, data.select_data, with pipeline.dataset.select_rows); "
        "'model' builds models/base offline and sets sft.model_path; 'sft' runs `clew sft` "
        "and sets trainer.policy.model.path to its final policy; 'train' runs GRPO; 'test' "
        "(after 'train') writes data/test.parquet of held-out mazes and evaluates GRPO's "
        "start, final and best policies on them as GRPO evaluates, in test/<name>/ and "
        "test.json.",
    )
    dataset: PipelineDatasetConfig = Field(
        default_factory=PipelineDatasetConfig, description="The 'dataset' stage."
    )
    model: PipelineModelConfig = Field(
        default_factory=PipelineModelConfig, description="The 'model' stage."
    )
    test: PipelineTestConfig = Field(
        default_factory=PipelineTestConfig, description="The 'test' stage."
    )
