"""Reading a maze action out of a reply, three ways (``PromptFormat.reply_parser``).

* ``last``: clew's reading (``actions.parse_action``): the last well-formed action of the
  env's action format.
* ``visgym``: VisGym's own evaluation (visgym/VisGym, ``gymnasium/vlm/interactor.py``,
  ``Interactor.parse_output`` with its default ``prefer="last"``): the reply is normalised
  (code fences, backticks, box and think markers and ``Action:`` labels removed, spaces
  collapsed), every balanced ``(...)`` is tried with a bare first name quoted, and the
  last that ``ast.literal_eval`` reads as a tuple with a string first goes to the env;
  with none, the raw reply does. The env then reads it as ``Maze2DEnv.step`` does
  (``gymnasium/envs/maze_2d/maze_2d.py``) and answers what it cannot execute with
  VisGym's own sentences.
* ``skyrl``: SkyRL's VisGym integration (NovaSky-AI/SkyRL,
  ``examples/train/visgym/utils.py`` ``extract_action``): the first quoted-name 2-tuple
  of the reply, then the same after stripping markdown, then an unquoted name, then a JSON
  ``{"action": ..., "args": ...}``; a reply with none gets SkyRL's parse-failure message
  (``env_sft.py`` ``_build_parse_error``) without reaching the env, and one with a tuple
  goes to ``Maze2DEnv.step`` as above.

Written out rather than imported: VisGym ships as a fork of gymnasium with pygame, SkyRL
as a training framework; clew needs a few dozen lines of each. docs/prompt-formats.md
names the commits these were read from. Parsing never raises.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from clew.envs.maze.actions import Action, ParseFailure, parse_action

REPLY_PARSERS = ("last", "visgym", "skyrl")


@dataclass(frozen=True)
class Invalid:
    """A reply the env read but cannot execute (VisGym: a wrong payload or action name);
    ``reason`` is the env's sentence about it."""

    reason: str


Reading = Action | ParseFailure | Invalid


def read_reply(text: object, parser: str, action_format: str) -> Reading:
    """The action ``text`` asks for under ``parser``, or why there is none. Never raises."""
    if parser == "last":
        return parse_action(text, action_format)
    if not isinstance(text, str):
        return ParseFailure(f"the reply was not text but {type(text).__name__}")
    if parser == "visgym":
        return visgym_step(visgym_parse_output(text))
    if parser == "skyrl":
        extracted = skyrl_extract_action(text)
        if extracted is None:
            return ParseFailure(SKYRL_PARSE_ERROR)
        return visgym_step(extracted)
    return ParseFailure(f"unknown reply parser {parser!r}")


# --- VisGym: Maze2DEnv.step's reading of an action string ---------------------------------

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_STOP_CHARS = frozenset("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def visgym_step(action: str) -> Reading:
    """What VisGym's maze does with the action string ``action``."""
    try:
        parsed = ast.literal_eval(action)
    except Exception as exc:  # noqa: BLE001 - VisGym reports any failure in its sentence
        # ast's message may name an object's address ("<ast.Name object at 0x7f...>"),
        # which would make the same reply read differently from run to run.
        why = _ADDRESS.sub("", str(exc))
        return ParseFailure(
            f"Cannot parse action string {action!r}: {why} so the action is invalid."
        )
    if not isinstance(parsed, tuple) or len(parsed) != 2:
        return ParseFailure(
            "The action format is invalid. The action should be a tuple of two elements with "
            "the first element being the action name and the second element being the action "
            "payload."
        )
    branch, payload = parsed
    if branch == "move":
        # gymnasium's Discrete(4).contains: a Python int (bool included) in [0, 4)
        if isinstance(payload, int) and 0 <= int(payload) < 4:
            return Action("move", int(payload))
        return Invalid(
            f"The action {payload} is not in the valid action space of {branch} so nothing is "
            "executed."
        )
    if branch == "stop":
        # gymnasium's Text(4).contains: 1-4 alphanumeric characters
        if isinstance(payload, str) and 1 <= len(payload) <= 4 and set(payload) <= _STOP_CHARS:
            return Action("stop")
        return Invalid(
            f"The action {payload} is not in the valid action space of {branch} so nothing is "
            "executed."
        )
    return Invalid(f"The action name '{branch}' is not recognized in the available action space.")


# --- VisGym: Interactor.parse_output ------------------------------------------------------

_IDENT = re.compile(r"^\(\s*([A-Za-z_]\w*)(\s*,)")


def _visgym_normalize(text: str) -> str:
    t = re.sub(r"```[\w-]*", "", text)
    t = t.replace("```", "").replace("`", "")
    t = t.replace("<|begin_of_box|>", "").replace("<|end_of_box|>", "")
    t = t.replace("\u25c1think\u25b7", "").replace("\u25c1/think\u25b7", "")
    t = re.sub(r"\bAction\s*:\s*", " ", t, flags=re.IGNORECASE)
    return re.sub(r"\s+", " ", t).strip()


def _quote_first_identifier(s: str) -> str:
    m = _IDENT.search(s)
    if not m:
        return s
    return s[: m.start()] + "(" + f"'{m.group(1)}'" + m.group(2) + s[m.end() :]


def visgym_parse_output(output: str) -> str:
    """The action string VisGym's evaluation sends to the env for the reply ``output``."""
    text = _visgym_normalize(output)
    if not text:
        return output
    candidates = []
    n, i = len(text), 0
    while i < n:
        if text[i] != "(":
            i += 1
            continue
        depth, j = 0, i
        while j < n:
            ch = text[j]
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
                if depth == 0:
                    attempt = _quote_first_identifier(text[i : j + 1])
                    try:
                        node = ast.literal_eval(attempt)
                        if isinstance(node, tuple) and len(node) >= 1 and isinstance(node[0], str):
                            candidates.append(attempt)
                    except Exception:  # noqa: BLE001, S110 - not a tuple: try the next one
                        pass
                    break
            j += 1
        i += 1
    return candidates[-1] if candidates else output


# --- SkyRL: extract_action ----------------------------------------------------------------

SKYRL_PARSE_ERROR = (
    "Action parsing failed. Could not find a valid action tuple in your response."
    "\nPlease respond with exactly one action as a Python tuple."
    "\nAvailable actions: 'move', 'stop'"
    "\nExample: ('move', 0) or ('stop', 'stop')"
)

_TUPLE_START = re.compile(r"""\(\s*['"](\w+)['"]\s*,""")
_TUPLE_START_UNQUOTED = re.compile(r"""\(\s*(\w+)\s*,""")
_JSON_ACTION = re.compile(
    r"""\{\s*["']action["']\s*:\s*["'](\w+)["']\s*,\s*["']args?["']\s*:\s*(.+?)\}""", re.DOTALL
)


def _balanced(text: str, start: int) -> str | None:
    depth, in_str, i = 0, None, start
    while i < len(text):
        c = text[i]
        if in_str:
            if c == "\\" and i + 1 < len(text):
                i += 2
                continue
            if c == in_str:
                in_str = None
        elif c in ("'", '"'):
            in_str = c
        elif c in ("(", "["):
            depth += 1
        elif c in (")", "]"):
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
        i += 1
    return None


def _is_pair(candidate: str) -> bool:
    try:
        parsed = ast.literal_eval(candidate)
    except Exception:  # noqa: BLE001 - not a literal
        return False
    return isinstance(parsed, tuple) and len(parsed) == 2


def _first_quoted(text: str) -> str | None:
    for match in _TUPLE_START.finditer(text):
        candidate = _balanced(text, match.start())
        if candidate is not None and _is_pair(candidate):
            return candidate
    return None


def _json_fallback(text: str) -> str | None:
    match = _JSON_ACTION.search(text)
    if not match:
        return None
    args = match.group(2).strip()
    try:
        value = ast.literal_eval(args)
    except Exception:  # noqa: BLE001 - try JSON next
        try:
            value = json.loads(args)
        except Exception:  # noqa: BLE001
            return None
    candidate = repr((match.group(1), value))
    return candidate if _is_pair(candidate) else None


def skyrl_extract_action(output: str) -> str | None:
    """The action string SkyRL's VisGym env sends to VisGym for ``output``; None when it
    finds none (a parse failure)."""
    found = _first_quoted(output)
    if found:
        return found
    stripped = re.sub(r"```[\w]*\n?", "", output).replace("`", "")
    if stripped != output:
        found = _first_quoted(stripped)
        if found:
            return found
    for text in (output, stripped):
        for match in _TUPLE_START_UNQUOTED.finditer(text):
            candidate = _balanced(text, match.start())
            if candidate is None:
                continue
            fixed = candidate.replace(match.group(1), f"'{match.group(1)}'", 1)
            if _is_pair(fixed):
                return fixed
    for text in (output, stripped):
        found = _json_fallback(text)
        if found:
            return found
    return None
