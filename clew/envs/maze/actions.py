"""Reading an action out of a model's reply.

Two formats, chosen per env: VisGym's tuple form ``('move', d)`` (d: 0 right, 1 up,
2 left, 3 down) and ``('stop', 'stop')``, and the keyword form ``<action>up</action>``.
Replies are free text: the last well-formed action of the env's format counts, so a model
may think aloud before it answers. Parsing never raises: anything unreadable comes back
as a ``ParseFailure`` whose reason the env shows the agent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clew.envs.maze.generate import DIRECTION_NAMES

ACTION_FORMATS = ("tuple", "keyword")

_TUPLE = re.compile(
    r"""\(\s*(['"])(move|stop)\1\s*,\s*(?:(\d+)|(['"])(stop)\4)\s*\)""", re.IGNORECASE
)
_KEYWORD = re.compile(r"<action>\s*(right|up|left|down|stop)\s*</action>", re.IGNORECASE)


@dataclass(frozen=True)
class Action:
    """A parsed action: ``kind`` is "move" (with ``direction`` 0-3) or "stop"."""

    kind: str
    direction: int | None = None


@dataclass(frozen=True)
class ParseFailure:
    """A reply with no well-formed action; ``reason`` is shown to the agent."""

    reason: str


def format_action(action: Action, action_format: str) -> str:
    """The canonical text of ``action`` in ``action_format`` (what demonstrations say)."""
    if action_format == "tuple":
        return "('stop', 'stop')" if action.kind == "stop" else f"('move', {action.direction})"
    word = "stop" if action.kind == "stop" else DIRECTION_NAMES[action.direction or 0]
    return f"<action>{word}</action>"


def format_help(action_format: str) -> str:
    """One sentence on how to write actions in ``action_format``."""
    if action_format == "tuple":
        return (
            "Answer with ('move', d) where d is 0 for right, 1 for up, 2 for left, 3 for down, "
            "or ('stop', 'stop') to end the episode."
        )
    return (
        "Answer with <action>DIR</action> where DIR is right, up, left or down, "
        "or <action>stop</action> to end the episode."
    )


def parse_action(text: object, action_format: str) -> Action | ParseFailure:
    """The last well-formed action in ``text``, or why there is none. Never raises."""
    if not isinstance(text, str):
        return ParseFailure(f"the reply was not text but {type(text).__name__}")
    if action_format == "keyword":
        matches = list(_KEYWORD.finditer(text))
        if not matches:
            return ParseFailure(_failure_reason(text, action_format))
        word = matches[-1].group(1).lower()
        if word == "stop":
            return Action("stop")
        return Action("move", DIRECTION_NAMES.index(word))
    if action_format != "tuple":
        return ParseFailure(f"unknown action format {action_format!r}")
    for match in reversed(list(_TUPLE.finditer(text))):
        kind = match.group(2).lower()
        if kind == "stop" and match.group(5) is not None:
            return Action("stop")
        if kind == "move" and match.group(3) is not None:
            digits = match.group(3)
            if len(digits) == 1 and digits in "0123":
                return Action("move", int(digits))
    return ParseFailure(_failure_reason(text, action_format))


def _failure_reason(text: str, action_format: str) -> str:
    shown = text.strip()
    if len(shown) > 60:
        shown = shown[:57] + "..."
    expected = (
        "('move', 0-3) or ('stop', 'stop')"
        if action_format == "tuple"
        else "<action>right|up|left|down|stop</action>"
    )
    return f"could not parse an action from {shown!r}; expected {expected}"
