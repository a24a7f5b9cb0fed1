"""Prompt formats: everything a policy sees of an episode and how its reply is read.

A checkpoint is trained on one conversation layout: a task prompt worded one way, the
image before or after the text, feedback sentences of its own, a reply read by one rule.
Prompting it any other way takes it out of its training distribution, so the layout is
configuration, not code: a ``PromptFormat`` names every piece, formats are registered by
name (an env family registers the formats it can render, ``register_format``), and a run
picks one by name and may override any field (``environment.prompt_format``, or the env
option ``prompt_format`` in a dataset row or on the command line). How many past images
stay visible is the rollout's ``generator.keep_last_k_images`` (VisGym and SkyRL keep them
all, its default).

The env renders the texts (it knows the facts they are filled from) and reads the replies;
``clew.models.chat.ChatFormat`` lays the turns out in the chat template's tokens, with the
system prompt and the text/image order the format gives through ``Observation``. Rollouts,
SFT demonstrations, evaluation, ``clew play``, the playground and ``clew prompt`` all build
their episodes through the env, so they all present the same format.

Templates are ``str.format`` strings; the fields an env fills are listed with its formats
(for the maze: ``clew.envs.maze.formats``). A template naming a field the env does not
fill is refused when the format is resolved, before any work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from clew.errors import EnvError

DEFAULT_FORMAT = "clew"
IMAGE_CODECS = ("png", "jpeg")


@dataclass(frozen=True)
class PromptFormat:
    """A conversation layout. Every field is documented here, once; docs/prompt-formats.md
    lists the named formats and where their strings come from."""

    name: str = DEFAULT_FORMAT
    """The registered format this one is (or was derived from by overrides)."""

    system_prompt: str | None = None
    """A system turn opening every episode; None: the chat template's own default, as
    ``apply_chat_template`` renders a conversation without one (Qwen2-VL's and
    Qwen2.5-VL's "You are a helpful assistant.", none for Qwen3-VL); "": no system turn."""

    task_prompt: str = "{env_prompt}"
    """The task description: ``{env_prompt}`` is the env's own wording; a format may
    rewrite it from the env's fields (the maze's: grid_size, max_turns, ...)."""

    first_turn: str = "{task}"
    """The text of the episode's first user turn: ``{task}`` (the task prompt) and the
    turn fields (``{step}``, ``{steps_left}``, ``{max_turns}``)."""

    later_turn: str = "{feedback}"
    """The text of every later user turn: ``{feedback}`` (the outcome's sentence), the
    turn fields, and ``{task}`` for formats that repeat the instructions."""

    feedback: Mapping[str, str] = field(default_factory=dict)
    """The sentence for each outcome of a reply (the env's events: for the maze ``moved``,
    ``wall``, ``stop``, ``reached``, ``parse_error``, ``invalid``), filled from the
    outcome's fields; an outcome not listed gets the env's own sentence (``{note}``)."""

    text_first: bool = False
    """Within a user turn, the text before the image (SkyRL's VisGym env) instead of the
    image before the text (clew's and VisGym's own layout)."""

    image_codec: str = "png"
    """How a frame reaches the policy: ``png``, exactly as rendered; ``jpeg``, through a JPEG
    at Pillow's default quality (75) and back, as VisGym's evaluation sends frames and its
    SFT data store them."""

    reply_parser: str = "last"
    """How an action is read from a reply: the env's parsers by name (the maze: ``last``,
    the last well-formed action of the env's action format; ``visgym``, VisGym's own
    reading; ``skyrl``, SkyRL's VisGym reading, the first tuple with fallbacks)."""

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PromptFormat))

_FORMATS: dict[str, PromptFormat] = {}


def register_format(fmt: PromptFormat) -> None:
    """Make ``fmt`` available by its name."""
    if fmt.name in _FORMATS:
        raise ValueError(f"prompt format {fmt.name!r} is already registered")
    _FORMATS[fmt.name] = fmt


def format_names() -> list[str]:
    from clew.envs.base import list_envs

    list_envs()  # the built-in envs register their formats on import
    return sorted(_FORMATS)


def resolve_format(spec: str | Mapping[str, Any] | PromptFormat | None) -> PromptFormat:
    """The format ``spec`` names: a registered name, or a mapping of fields over a named
    base (``{"name": "visgym", "system_prompt": "..."}``; no name: clew's). Unknown names
    and keys fail with the nearest accepted one."""
    if isinstance(spec, PromptFormat):
        return spec
    if spec is None:
        spec = DEFAULT_FORMAT
    if isinstance(spec, str):
        return _named(spec)
    if not isinstance(spec, Mapping):
        raise EnvError(
            "prompt_format must be a format name or a mapping of its fields, got "
            f"{type(spec).__name__}; names: {', '.join(format_names())}"
        )
    base = _named(spec.get("name", DEFAULT_FORMAT))
    unknown = sorted(set(spec) - set(FIELDS))
    if unknown:
        hints = []
        for key in unknown:
            near = difflib.get_close_matches(str(key), FIELDS, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        raise EnvError(
            f"unknown prompt_format key(s): {', '.join(hints)}; accepted: {', '.join(FIELDS)}"
        )
    values = {k: v for k, v in spec.items() if k != "name"}
    _check_types(values)
    return dataclasses.replace(base, **values)


def _named(name: Any) -> PromptFormat:
    names = format_names()
    if name not in _FORMATS:
        near = difflib.get_close_matches(str(name), names, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise EnvError(f"unknown prompt format {name!r}{hint}; formats: {', '.join(names)}")
    return _FORMATS[name]


def _check_types(values: Mapping[str, Any]) -> None:
    for key, value in values.items():
        if key in ("task_prompt", "first_turn", "later_turn", "reply_parser"):
            ok = isinstance(value, str)
        elif key == "system_prompt":
            ok = value is None or isinstance(value, str)
        elif key == "image_codec":
            ok = value in IMAGE_CODECS
        elif key == "text_first":
            ok = isinstance(value, bool)
        else:  # feedback
            ok = isinstance(value, Mapping) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            )
        if not ok:
            expected = {
                "system_prompt": "a string or null",
                "text_first": "true or false",
                "image_codec": f"one of {', '.join(IMAGE_CODECS)}",
                "feedback": "a mapping of outcome names to strings",
            }.get(key, "a string")
            raise EnvError(f"prompt_format.{key} must be {expected}, got {value!r}")


def template_fields(template: str) -> set[str]:
    """The field names a ``str.format`` template uses."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def check_templates(
    fmt: PromptFormat,
    task_fields: set[str],
    turn_fields: set[str],
    outcomes: Mapping[str, set[str]],
) -> None:
    """Refuse a format whose templates name fields the env does not fill, or outcomes the
    env does not have (``outcomes``: each outcome's fields)."""

    def check(where: str, template: str, allowed: set[str]) -> None:
        try:
            used = template_fields(template)
        except ValueError as exc:
            raise EnvError(f"prompt_format.{where} is not a valid template: {exc}") from None
        bad = sorted(used - allowed)
        if bad:
            raise EnvError(
                f"prompt_format.{where} uses unknown field(s) {', '.join('{' + b + '}' for b in bad)}; "
                f"it may use {', '.join('{' + a + '}' for a in sorted(allowed))}"
            )

    check("task_prompt", fmt.task_prompt, task_fields | {"env_prompt"})
    check("first_turn", fmt.first_turn, turn_fields | {"task"})
    check("later_turn", fmt.later_turn, turn_fields | {"task", "feedback"})
    for outcome, template in fmt.feedback.items():
        if outcome not in outcomes:
            near = difflib.get_close_matches(outcome, sorted(outcomes), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise EnvError(
                f"prompt_format.feedback has an unknown outcome {outcome!r}{hint}; "
                f"outcomes: {', '.join(sorted(outcomes))}"
            )
        check(f"feedback.{outcome}", template, outcomes[outcome] | turn_fields)


def encode_frame(image: Image.Image, codec: str) -> Image.Image:
    """``image`` as the policy receives it under ``codec`` (``PromptFormat.image_codec``)."""
    if codec == "png":
        return image
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG")
    buf.seek(0)
    with Image.open(buf) as decoded:
        return decoded.convert("RGB")
