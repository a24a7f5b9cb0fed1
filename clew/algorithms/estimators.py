"""The advantage-estimator registry: each estimator says what it needs from the rollouts.

An estimator turns the rewards of one training step into advantages. Every estimator is
called the same way, ``fn(batch, settings) -> AdvantageResult``:

* ``batch`` (:class:`EstimatorBatch`) holds one reward and one group id per trajectory and,
  when the estimator's spec asks for them, per-turn data: ``turn_rewards`` (each turn's
  reward) and ``state_keys`` (a hashable key of the observation each turn acted from; the
  rollout records them only when an estimator needs them, as hashing every frame costs).
* ``settings`` is the ``trainer.algorithm`` config section as a mapping, under the config's
  own key names (sections nested: ``settings["gigpo"]["gamma"]``); an estimator picks what
  it uses with :func:`setting`, which also gives it a default when a key is absent.

The trainer asks the registry what to collect (:class:`EstimatorSpec` ``needs``) and never
compares names, so an estimator registered outside clew trains like a built-in one::

    from clew.algorithms import AdvantageResult, EstimatorBatch, register_estimator

    @register_estimator("my_estimator", needs={"turn_rewards"}, min_group_size=2)
    def my_estimator(batch: EstimatorBatch, settings) -> AdvantageResult: ...

Register before ``clew.config.load_config`` (import the module that holds it first): the
config accepts any registered name for ``trainer.algorithm.advantage_estimator`` and refuses
the others, naming the registered ones.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from clew.registry import lookup

GroupIds = Tensor | Sequence[Hashable]
EstimatorSettings = Mapping[str, Any]

# What an estimator may ask the rollouts for, beyond one reward and group id per trajectory.
ROLLOUT_NEEDS: frozenset[str] = frozenset({"turn_rewards", "state_keys"})


@dataclass(frozen=True)
class AdvantageResult:
    """What an estimator returns.

    Attributes:
        advantages: ``Float[N]`` one advantage per trajectory (exactly 0 in zero-spread groups).
        keep: ``Bool[N]`` False for members of zero-spread groups when the caller asked for
            ``drop_zero_spread=True``; all True otherwise.
        num_groups: number of distinct group ids.
        zero_spread_groups: how many of those groups had all rewards equal.
        turn_advantages: per trajectory ``Float[T_i]``, one advantage per turn, from
            estimators that assign credit within an episode (``gigpo``); None when every
            turn shares its trajectory's advantage.
        stats: estimator-specific statistics, logged as ``train/<name>``.
    """

    advantages: Tensor
    keep: Tensor
    num_groups: int
    zero_spread_groups: int
    turn_advantages: tuple[Tensor, ...] | None = None
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EstimatorBatch:
    """The rollouts of one step, as an estimator sees them.

    Attributes:
        rewards: ``Float[N]`` one scalar per trajectory.
        group_ids: ``Long[N]`` or ``N`` hashables: the prompt each trajectory came from.
        turn_rewards: per trajectory ``Float[T_i]``, each turn's reward; None unless the
            estimator's spec needs ``"turn_rewards"``.
        state_keys: per trajectory ``T_i`` hashables naming the state each turn acted from;
            None unless the spec needs ``"state_keys"``.
    """

    rewards: Tensor
    group_ids: GroupIds
    turn_rewards: Sequence[Tensor] | None = None
    state_keys: Sequence[Sequence[Hashable]] | None = None

    def missing(self, needs: Iterable[str]) -> list[str]:
        """The names in ``needs`` this batch does not carry."""
        return sorted(n for n in needs if getattr(self, n) is None)


EstimatorFn = Callable[[EstimatorBatch, EstimatorSettings], AdvantageResult]


@dataclass(frozen=True)
class EstimatorSpec:
    """A registered estimator and what it needs.

    Attributes:
        name: the ``trainer.algorithm.advantage_estimator`` value that picks it.
        fn: ``fn(batch, settings) -> AdvantageResult``.
        needs: per-turn data it reads from the batch, a subset of :data:`ROLLOUT_NEEDS`.
        min_group_size: the least ``generator.n_samples_per_prompt`` that gives it a signal
            (2 for estimators that compare a prompt's samples with each other).
    """

    name: str
    fn: EstimatorFn
    needs: frozenset[str] = frozenset()
    min_group_size: int = 1


ADVANTAGE_ESTIMATORS: dict[str, EstimatorSpec] = {}


def register_estimator(
    name: str, *, needs: Iterable[str] = (), min_group_size: int = 1
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: register ``fn(batch, settings)`` as the advantage estimator ``name``.

    Raises ``ValueError`` if the name is taken (remove the old entry from
    :data:`ADVANTAGE_ESTIMATORS` first to replace it on purpose) or ``needs`` names data the
    rollouts do not provide.
    """
    wanted = frozenset(needs)
    if unknown := sorted(wanted - ROLLOUT_NEEDS):
        accepted = ", ".join(repr(n) for n in sorted(ROLLOUT_NEEDS))
        raise ValueError(
            f"advantage estimator {name!r} needs {unknown}, which rollouts do not provide; "
            f"accepted: {accepted}"
        )
    if min_group_size < 1:
        raise ValueError(f"min_group_size must be >= 1, got {min_group_size}")

    def decorator(fn: EstimatorFn) -> EstimatorFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = EstimatorSpec(name, fn, wanted, min_group_size)
        return fn

    return decorator


def get_estimator(name: str) -> EstimatorSpec:
    """The spec registered as ``name``; ``ValueError`` listing accepted names if none."""
    return lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")


def estimator_names() -> list[str]:
    """Every registered estimator name, sorted."""
    return sorted(ADVANTAGE_ESTIMATORS)


def setting(settings: EstimatorSettings, key: str, default: Any) -> Any:
    """The value at dotted ``key`` of ``settings`` (``"gigpo.gamma"``), or ``default``."""
    node: Any = settings
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def compute_advantages(
    name: str, batch: EstimatorBatch, settings: EstimatorSettings | None = None
) -> AdvantageResult:
    """Call estimator ``name`` on ``batch``; ``ValueError`` if the batch lacks what it needs."""
    spec = get_estimator(name)
    if missing := batch.missing(spec.needs):
        raise ValueError(
            f"advantage estimator {name!r} needs {missing} in its batch; collect them from "
            "the rollouts (see EstimatorSpec.needs)"
        )
    return spec.fn(batch, settings or {})
