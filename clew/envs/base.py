"""The environment protocol, the expert protocol, and the registry of environment ids.

An environment is plain Python (no Ray): ``reset(seed) -> Observation`` and
``step(action_text) -> (Observation, reward, done, info)``. Observations carry images and
text, because the policies clew trains read both. Environments are created by id through
``make``; ids are registered with their default options so other sizes or rule variants
are one ``register`` call, not a subclass. Every episode gets its own instance, and the
rollout loop resets and steps instances on several threads at once
(``generator.env_workers``), so instances must not share mutable state.

An id may be registered with two optional companions, and everything in clew that goes
beyond playing episodes reaches an env through them, never through its module:

* an ``Expert``: a solver that labels the env's current state with its best replies and
  says how many turns it needs to finish from there. SFT plays it for demonstrations,
  DAgger asks it which of a policy's turns were mistakes, and the SFT evaluation measures
  how often the policy agrees with it. Optional methods add to what it can do:
  ``detour_actions`` (deliberate wrong turns for demonstrations, ``DetourExpert``) and
  ``state_groups`` (how agreement is broken down, ``GroupingExpert``); an env may offer
  ``start_cells`` (``StartsAnywhere``) for demonstrations that start off the usual start,
  and ``action_names`` (``NamedActions``) for the replies of every action.
* ``DatasetHooks``: what a dataset row of the env records (``row_facts``: the split of a
  seed, a key of its task for distinct sets, env-specific metadata) and the env's own
  dataset statistics. Without them every seed of a split's seed range is a row.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from PIL import Image

from clew.errors import EnvError


@dataclass
class Observation:
    """What the agent sees after a reset or a step: new images and a text message.

    ``text_first``: the text comes before the images in the user turn (else after them);
    ``system``: the system prompt that opens the episode (read from the first observation;
    None: none). Both come from the env's prompt format (``clew.envs.prompt_format``).
    ``state``: a name for the state the images show, equal for two observations of one task
    exactly when their images are equal, from an env that can name it for less than a digest
    of its frames costs (GiGPO's step groups, ``clew.rollout.trajectory.observation_key``);
    None: the frames' digest names it.
    """

    images: list[Image.Image]
    text: str
    text_first: bool = False
    system: str | None = None
    state: str | None = None


@runtime_checkable
class Env(Protocol):
    """A multi-turn environment with image observations and a sparse reward."""

    max_turns: int

    def reset(self, seed: int) -> Observation: ...

    def step(self, action_text: str) -> tuple[Observation, float, bool, dict[str, Any]]: ...


@runtime_checkable
class Expert(Protocol):
    """A solver of an env: the best replies from the env's current state (after ``reset``
    and any steps), in the env's own action format.

    ``turns_to_finish`` is the number of turns its own play needs from that state to earn
    the success reward (a final ``stop`` counted where the env needs one), whatever turns
    are left; None where it cannot succeed at all. It must fall by one with each optimal
    turn: that is how DAgger tells an optimal turn of a policy from a mistake, and the
    dataset's ``solvable`` (its play fits in the turn budget) is read off it at reset.
    """

    def best_actions(self, env: Any) -> list[str]: ...

    def turns_to_finish(self, env: Any) -> int | None: ...


@runtime_checkable
class DetourExpert(Expert, Protocol):
    """An expert that also offers wrong turns it can recover from (SFT's ``detour_prob``)."""

    def detour_actions(self, env: Any) -> list[str]:
        """Replies that are not optimal here and after which the expert still finishes
        within the turns left."""
        ...


@runtime_checkable
class GroupingExpert(Expert, Protocol):
    """An expert that names groups of states, by which agreement with it is reported."""

    def state_groups(self, env: Any) -> list[str]:
        """The groups the env's current state belongs to (names usable in metric keys)."""
        ...


@runtime_checkable
class StartsAnywhere(Protocol):
    """An env whose episodes can start elsewhere than the seed's own start (SFT's
    ``start_anywhere``): ``reset(seed, start=s)`` for any ``s`` of ``start_cells()``."""

    def start_cells(self) -> list[Any]:
        """Where an episode of the current seed may start, the goal still within the budget."""
        ...

    def reset(self, seed: int, start: Any = None) -> Observation: ...


@runtime_checkable
class NamedActions(Protocol):
    """An env that names its actions: ``{name: reply text}`` for every distinct action in
    its current action format (``clew render --actions``, agreement with the expert)."""

    def action_names(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class RowFacts:
    """What an env says about the episode of one seed, for its dataset row.

    ``split``: the split this episode belongs to (None: whichever split's seeds are being
    walked); ``key``: what makes two episodes the same task, for a set of distinct ones
    (None: the seed); ``metadata``: JSON-serialisable facts stored with the row.
    """

    split: str | None = None
    key: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetHooks:
    """How ``clew dataset`` makes and describes rows of an env (``clew.data.rows``).

    ``row_facts(env)`` runs right after ``env.reset(seed)``. ``stats(rows)`` adds the env's
    own statistics of a list of rows to the generic ones, and ``describe(stats)`` gives
    the lines that print them.
    """

    row_facts: Callable[[Any], RowFacts] | None = None
    stats: Callable[[Sequence[Any]], dict[str, Any]] | None = None
    describe: Callable[[dict[str, Any]], list[str]] | None = None


@dataclass(frozen=True)
class EnvSpec:
    """A registered environment id: how to build it, its default options, and its optional
    expert and dataset hooks."""

    env_id: str
    factory: Callable[..., Env]
    defaults: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    accepted_options: frozenset[str] = frozenset()
    expert: Expert | None = None
    dataset: DatasetHooks = field(default_factory=DatasetHooks)

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
    expert: Expert | None = None,
    dataset: DatasetHooks | None = None,
) -> None:
    """Register ``env_id``; ``factory(**options)`` builds the env from its resolved options.

    ``expert`` solves the env's states (SFT demonstrations, DAgger, agreement); ``dataset``
    says what its dataset rows record. Both are optional: without an expert the env can be
    played and trained on with GRPO, not imitated.
    """
    if env_id in _REGISTRY:
        raise ValueError(f"environment id {env_id!r} is already registered")
    if expert is not None and not isinstance(expert, Expert):
        raise TypeError(
            f"the expert of {env_id!r} must have best_actions(env) and turns_to_finish(env), "
            f"got {type(expert).__name__}"
        )
    _REGISTRY[env_id] = EnvSpec(
        env_id,
        factory,
        dict(defaults or {}),
        description,
        frozenset(accepted_options),
        expert,
        dataset or DatasetHooks(),
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


def expert_for(env_id: str) -> Expert:
    """The expert registered with ``env_id``; an env without one fails with what needs it."""
    expert = spec(env_id).expert
    if expert is None:
        raise EnvError(
            f"environment {env_id!r} has no expert: SFT demonstrations, DAgger and agreement "
            "need one (register the env with expert=...)"
        )
    return expert


def list_envs() -> list[EnvSpec]:
    """Every registered environment, sorted by id."""
    _load_builtin_envs()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def _load_builtin_envs() -> None:
    # Imported lazily so that `clew.envs.base` stays free of the maze code it registers.
    import clew.envs.maze  # noqa: F401
    from clew.envs.plugins import load_plugins

    load_plugins()


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
