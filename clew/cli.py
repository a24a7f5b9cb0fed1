"""The ``clew`` command: one entry point for data, training, evaluation and serving.

Each subcommand (in ``clew.commands``) parses its arguments and calls one function of the
package. Errors a user can cause (a typo, a bad path) are ``ClewError``s and print as one
line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

from clew.commands import COMMANDS
from clew.errors import ClewError


def versions() -> str:
    """clew's version and those of what a bug report needs: Python, torch (and its CUDA),
    transformers, peft and Ray where installed."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from clew import __version__

    parts = [f"python {platform.python_version()}"]
    for package in ("torch", "transformers", "peft", "ray"):
        try:
            parts.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            parts.append(f"{package} not installed")
    import torch

    parts.append(f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA build")
    return f"clew {__version__} ({', '.join(parts)})"


class _Versions(argparse.Action):
    """``--version``: computed when asked for, since it imports torch."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the versions and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(versions())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clew", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=_Versions)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (add, _, help_text) in COMMANDS.items():
        add(sub.add_parser(name, help=help_text, description=help_text))
    return parser


@contextlib.contextmanager
def plain_warnings(command: str) -> Iterator[None]:
    """Within the block, a warning clew raises prints as one line, ``clew COMMAND: warning:
    ...``, rather than Python's file, line and source line; others print as Python prints
    them."""
    shown = warnings.showwarning
    package = str(Path(__file__).parent)

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if str(filename).startswith(package):
            print(f"clew {command}: warning: {message}", file=file or sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_handler", None):
        parser.print_help()
        return 2
    try:
        with plain_warnings(args.command):
            return args._handler(args)
    except ClewError as exc:
        print(f"clew {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
