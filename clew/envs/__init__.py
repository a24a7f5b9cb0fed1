"""Environments: the protocol, the registry, and the built-in visual maze."""

from clew.envs.base import Env, EnvSpec, Observation, list_envs, make, register, spec

__all__ = ["Env", "EnvSpec", "Observation", "list_envs", "make", "register", "spec"]
