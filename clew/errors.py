"""User-facing errors.

Every error a user can cause by a typo or a wrong path is a ``ClewError``: its message says
what was wrong and what is accepted. The CLI prints these as one clean line (no traceback)
and exits with status 2; anything else is a bug and keeps its traceback.
"""


class ClewError(Exception):
    """An error whose message is meant for the user: what was wrong and what is accepted."""


class ConfigError(ClewError):
    """A configuration value or key that clew cannot accept."""


class EnvError(ClewError):
    """An unknown environment id or option."""


class ModelError(ClewError):
    """A model or processor directory that cannot be loaded."""


class CheckpointError(ClewError):
    """A checkpoint that is missing, incomplete or incompatible."""


class DataError(ClewError):
    """A dataset file or output location that cannot be used."""
