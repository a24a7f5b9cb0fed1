"""Configuration of the prompt datasets (``data.*``) and the environments (``environment.*``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from clew.config.section import Section

# SkyRL's ``environment.env_class`` names mapped onto clew's env families.
ENV_CLASS_ALIASES: dict[str, str] = {"visgym": "maze_2d"}


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
        description="Python modules that register environments (clew.envs.register), "
        "advantage estimators, policy losses, KL estimators or loggers, imported before the "
        "config's names are checked, in the driver and in every Ray worker: a module of the "
        "current directory or of an installed package. Installed packages can declare a "
        "'clew.envs' entry point instead.",
    )

    @field_validator("env_class")
    @classmethod
    def _resolve_alias(cls, value: str) -> str:
        return ENV_CLASS_ALIASES.get(value, value)
