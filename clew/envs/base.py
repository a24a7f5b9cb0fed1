"""The environment protocol and the registry of environment ids.

An environment is plain Python (no Ray): ``reset(seed) -> Observation`` and
``step(action_text) -> (Observation, reward, done, info)``. Observations carry images and
text, because the policies clew trains read both. Environments are created by id through
``make``; ids are registered with their default options so other sizes or rule variants
are one ``register`` call, not a subclass.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from PIL import Image

from clew.errors import EnvError


@dataclass
class Observation:
    """What the agent sees after a reset or a step: new images and a text message."""

    images: list[Image.Image]
    text: str


@runtime_checkable
class Env(Protocol):
    """A multi-turn environment with image observations and a sparse reward."""

    max_turns: int

    def reset(self, seed: int) -> Observation: ...

    def step(self, action_text: str) -> tuple[Observation, float, bool, dict[str, Any]]: ...


@dataclass(frozen=True)
class EnvSpec:
    """A registered environment id: how to build it and its default options."""

    env_id: str
    factory: Callable[..., Env]
    defaults: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    accepted_options: frozenset[str] = frozenset()

    def resolve_options(self, options: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(options) - self.accepted_options)
        if unknown:
            hints = []
            for key in unknown:
                near = difflib.get_close_matches(key, sorted(self.accepted_options), n=1)
                hints.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
            raise EnvError(
                f"unknown option(s) for {self.env_id}: {', '.join(hints)}; "
                f"accepted options: {', '.join(sorted(self.accepted_options))}"
            )
        return {**self.defaults, **options}


_REGISTRY: dict[str, EnvSpec] = {}


def register(
    env_id: str,
    factory: Callable[..., Env],
    *,
    defaults: dict[str, Any] | None = None,
    accepted_options: set[str] | frozenset[str],
    description: str = "",
) -> None:
    """Register ``env_id``; ``factory(**options)`` builds the env from its resolved options."""
    if env_id in _REGISTRY:
        raise ValueError(f"environment id {env_id!r} is already registered")
    _REGISTRY[env_id] = EnvSpec(
        env_id, factory, dict(defaults or {}), description, frozenset(accepted_options)
    )


def spec(env_id: str) -> EnvSpec:
    """The registered spec of ``env_id``; unknown ids fail with the list of known ones."""
    _load_builtin_envs()
    if env_id not in _REGISTRY:
        near = difflib.get_close_matches(env_id, sorted(_REGISTRY), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise EnvError(
            f"unknown environment id {env_id!r}{hint}; known ids: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[env_id]


def make(env_id: str, **options: Any) -> Env:
    """Build the environment registered as ``env_id`` with ``options`` over its defaults."""
    s = spec(env_id)
    return s.factory(**s.resolve_options(options))


def list_envs() -> list[EnvSpec]:
    """Every registered environment, sorted by id."""
    _load_builtin_envs()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def _load_builtin_envs() -> None:
    # Imported lazily so that `clew.envs.base` stays free of the maze code it registers.
    import clew.envs.maze  # noqa: F401


def text_corpus(samples_per_env: int = 4) -> list[str]:
    """Prompts and feedback texts of every registered env, in every action format.

    Used to train the tokenizer of a policy built from scratch, so the task's own words
    become single tokens.
    """
    texts: list[str] = []
    for s in list_envs():
        formats = ("tuple", "keyword") if "action_format" in s.accepted_options else (None,)
        for fmt in formats:
            opts = {} if fmt is None else {"action_format": fmt}
            env = make(s.env_id, **opts)
            for seed in range(samples_per_env):
                obs = env.reset(seed)
                texts.append(obs.text)
                for reply in ("<action>up</action>", "('move', 0)", "('stop', 'stop')", "?"):
                    if env.done:
                        break
                    texts.append(env.step(reply)[0].text)
    return texts
