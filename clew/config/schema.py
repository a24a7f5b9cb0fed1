"""The typed configuration schema: ``ClewConfig``, one pydantic section per component.

Each section lives in its component's module (``data``, ``generator``, ``algorithm``,
``trainer``, ``sft``, ``pipeline``); this module assembles them and is where callers import
them from.

Why pydantic with ``extra="forbid"`` and ``strict=True``: a typo or a value of the wrong type
must fail before a run spends GPU hours, with the key named. Key names follow SkyRL wherever
the two share a concept, so a SkyRL launch script maps over by changing only its entry point.
Every field is documented once, where it is declared, in ``Field(description=...)``; ``schema_markdown()``
renders these descriptions as the configuration reference. Range and cross-field rules live
in ``validate.py`` so they are checked on the final config, however it was built.
"""

from __future__ import annotations

from pydantic import Field

from clew.config.algorithm import AlgorithmConfig, DynamicSamplingConfig, GigpoConfig
from clew.config.data import ENV_CLASS_ALIASES, DataConfig, EnvironmentConfig
from clew.config.generator import GeneratorConfig, InferenceEngineConfig, SamplingParams
from clew.config.pipeline import (
    PipelineConfig,
    PipelineDatasetConfig,
    PipelineModelConfig,
    PipelineTestConfig,
)
from clew.config.section import Section
from clew.config.sft import SFTConfig, SFTDaggerConfig, SFTOptimizerConfig
from clew.config.trainer import (
    KNOWN_LOGGERS,
    FsdpConfig,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    PlacementConfig,
    PolicyConfig,
    RefConfig,
    TrainerConfig,
)

__all__ = [
    "ENV_CLASS_ALIASES",
    "KNOWN_LOGGERS",
    "AlgorithmConfig",
    "ClewConfig",
    "DataConfig",
    "DynamicSamplingConfig",
    "EnvironmentConfig",
    "FsdpConfig",
    "GeneratorConfig",
    "GigpoConfig",
    "InferenceEngineConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "PipelineDatasetConfig",
    "PipelineModelConfig",
    "PipelineTestConfig",
    "PlacementConfig",
    "PolicyConfig",
    "RefConfig",
    "SFTConfig",
    "SFTDaggerConfig",
    "SFTOptimizerConfig",
    "SamplingParams",
    "Section",
    "TrainerConfig",
]


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
