"""The subcommands of ``clew``; importing this package registers them all."""

from clew.commands import agent, data, models, pipeline, prompt, serve, stages  # noqa: F401  (registration on import)
from clew.commands.registry import _COMMANDS as COMMANDS

__all__ = ["COMMANDS"]
