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
    select_data: list[str] = Field(
        default_factory=list,
        description="Parquet files of selection prompts, played greedily beside data.val_data "
        "at each GRPO evaluation, with the same settings and seed, in the same rollout "
        "(metrics select/...); their pass@1 (select/all/pass_at_1) picks the policy that "
        "trainer.export_best keeps, so the figure reported on val_data is not the one that "
        "chose it. Needs data.val_data. Empty: val_data's eval/all/pass_at_1 picks.",
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
    prompt_format: str | dict[str, Any] | None = Field(
        None,
        description="What the policy sees of an episode and how its reply is read: a "
        "format name ('clew', 'visgym': VisGym's own conversation, 'skyrl-visgym': the SkyRL + "
        "VisGym walkthrough's) or a mapping of clew.envs.prompt_format.PromptFormat's fields "
        "over a named base ({name: visgym, system_prompt: ...}); docs/prompt-formats.md. It "
        "replaces the env option prompt_format of every dataset row; null keeps the rows' own "
        "(clew's unless the dataset was made with another).",
    )
    reward_rule: str = Field(
        "task",
        description="How an episode's reward is computed: 'task', the env's own (the maze: 1 "
        "for stopping on the goal); 'skyrl_visgym', the SkyRL + VisGym walkthrough's (0.8 x "
        "the task reward + 0.2 x the share of replies with non-empty <observation>, "
        "<justification> and <action> tags), paid at the episode's end; rules registered in "
        "clew.envs.rewards. Evaluation reports the walkthrough's pass rule (reward > 0) "
        "beside the solve rate whatever the rule.",
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
