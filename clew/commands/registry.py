"""The subcommand registry of the ``clew`` command and the argument helpers they share."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from clew.errors import ClewError

Handler = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Handler, str]] = {}


def command(name: str, help_text: str):
    """Register a subcommand: the decorated function adds its arguments, and returns its handler."""

    def wrap(add_args: Callable[[argparse.ArgumentParser], Handler]):
        def add(p: argparse.ArgumentParser) -> None:
            p.set_defaults(_handler=add_args(p))

        _COMMANDS[name] = (add, None, help_text)  # type: ignore[assignment]
        return add_args

    return wrap


def parse_option(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as JSON where it can be (``7``, ``true``), else text."""
    if "=" not in text:
        raise ClewError(f"an option must look like key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _env_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(parse_option(o) for o in (args.option or []))


def _add_env_args(p: argparse.ArgumentParser, default: str | None = "maze_2d/easy") -> None:
    p.add_argument("--env-id", default=default, help="registered env id (see `clew envs`)")
    p.add_argument(
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="env option over the id's defaults, e.g. --option cell_px=28 (repeatable)",
    )
