"""Reward rules: how an episode's task reward and its replies become the trajectory reward.

A rule is a pure function ``rule(task_reward, replies) -> reward``: ``task_reward`` is what
the env paid at the episode's end (the maze: 1.0 for stopping on the goal, else 0.0; a
bool counts as 1.0 / 0.0) and ``replies`` are the texts of every reply the env was
stepped with, in order. Rules are registered by name (``REWARD_RULES``, ``reward_rule``):

- ``task``: the task reward unchanged (clew's own rule).
- ``skyrl_visgym``: the SkyRL + VisGym walkthrough's rule (``examples/train/visgym/
  env_sft.py`` in NovaSky-AI/SkyRL, the env of ``--env_variant sft``): 0.8 x the task
  reward + 0.2 x the share of replies in the observation/justification/action format
  (``has_valid_format``). SkyRL pays it once, at the episode's end, whether the episode
  ended by ``stop`` or by running out of turns (the task reward is then 0), and counts
  every reply, unparseable ones included, in the share.

``passes(reward)`` is SkyRL's pass rule: its ``eval/all/pass_at_1`` counts an eval prompt
as passed when its trajectory's reward is above 0 (``get_metrics_from_generator_output``
in ``skyrl/train/generators/utils.py``). Under ``skyrl_visgym`` format credit alone passes
(a well-formed reply earns up to 0.2 without reaching the goal), so it can read higher
than the solve rate; under ``task`` the two agree. An episode scored by a rule keeps the
env's own reward in ``Trajectory.task_reward``, which ``Trajectory.success`` reads.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from clew.errors import ConfigError

RewardRule = Callable[[float, Sequence[str]], float]

SKYRL_TASK_COEFF = 0.8
SKYRL_FORMAT_COEFF = 0.2
FORMAT_TAGS: tuple[str, ...] = ("observation", "justification", "action")
# SkyRL's patterns: the first <tag>...</tag> of each, non-greedy, across lines.
_TAG_PATTERNS = {tag: re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL) for tag in FORMAT_TAGS}


def has_valid_format(text: str) -> bool:
    """Whether ``text`` has each of ``<observation>``, ``<justification>`` and ``<action>``
    with non-blank content, judged on each tag's first match (SkyRL's ``_has_valid_format``:
    the tags may come in any order, and an empty first ``<action></action>`` fails even
    when a later one has content)."""
    if not isinstance(text, str):
        raise TypeError(f"a reply must be a str, got {type(text).__name__}")
    for pattern in _TAG_PATTERNS.values():
        match = pattern.search(text)
        if match is None or not match.group(1).strip():
            return False
    return True


def _check_task_reward(task_reward: float | bool) -> float:
    if not isinstance(task_reward, numbers.Real) or not math.isfinite(task_reward):
        raise ValueError(f"task reward must be a finite number, got {task_reward!r}")
    return float(task_reward)


def _check_replies(replies: Sequence[str]) -> Sequence[str]:
    if isinstance(replies, str) or not isinstance(replies, Sequence):
        raise TypeError(f"replies must be a sequence of reply texts, got {type(replies).__name__}")
    return replies


def format_share(replies: Sequence[str]) -> float:
    """The share of ``replies`` that pass ``has_valid_format``; an episode has at least one
    reply, so an empty list is an error (SkyRL would divide by zero)."""
    replies = _check_replies(replies)
    if not replies:
        raise ValueError("format share of an episode with no replies: there is none")
    return sum(has_valid_format(r) for r in replies) / len(replies)


def task_rule(task_reward: float | bool, replies: Sequence[str]) -> float:
    """clew's rule: the task reward, whatever the replies."""
    _check_replies(replies)
    return _check_task_reward(task_reward)


def skyrl_visgym_rule(task_reward: float | bool, replies: Sequence[str]) -> float:
    """The walkthrough's rule: ``0.8 * task_reward + 0.2 * format_share(replies)``."""
    task = _check_task_reward(task_reward)
    return SKYRL_TASK_COEFF * task + SKYRL_FORMAT_COEFF * format_share(replies)


REWARD_RULES: Mapping[str, RewardRule] = MappingProxyType(
    {"task": task_rule, "skyrl_visgym": skyrl_visgym_rule}
)
DEFAULT_RULE = "task"


def reward_rule(name: str) -> RewardRule:
    """The rule registered as ``name``; a clear error names the registered ones."""
    try:
        return REWARD_RULES[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown reward rule {name!r}; registered: {', '.join(REWARD_RULES)}"
        ) from None


def trajectory_reward(rule: str, task_reward: float | bool, replies: Sequence[str]) -> float:
    """The reward rule ``rule`` gives an episode that earned ``task_reward`` with ``replies``."""
    return reward_rule(rule)(task_reward, replies)


def passes(reward: float) -> bool:
    """SkyRL's pass rule for ``eval/all/pass_at_1``: the trajectory's reward is above 0."""
    return reward > 0
