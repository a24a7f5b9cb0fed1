"""Environments: the env and expert protocols, the registry, and the built-in visual maze."""

from clew.envs.base import (
    DatasetHooks,
    DetourExpert,
    Env,
    EnvSpec,
    Expert,
    GroupingExpert,
    NamedActions,
    Observation,
    RowFacts,
    StartsAnywhere,
    expert_for,
    list_envs,
    make,
    register,
    spec,
)

__all__ = [
    "DatasetHooks",
    "DetourExpert",
    "Env",
    "EnvSpec",
    "Expert",
    "GroupingExpert",
    "NamedActions",
    "Observation",
    "RowFacts",
    "StartsAnywhere",
    "expert_for",
    "list_envs",
    "make",
    "register",
    "spec",
]
