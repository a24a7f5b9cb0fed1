"""Name -> function registries: advantage estimators, losses, KL estimators, loggers.

Advantage estimators, policy losses, KL estimators and loggers are chosen by a name in the
config (SkyRL-style ``trainer.algorithm.*`` values, ``trainer.logger``), a plugin's names
included (``environment.modules``, ``clew.envs.plugins``). A plain dict plus a decorator keeps adding one a
two-line change, and one lookup helper makes every typo fail the same way: a ``ValueError``
that lists the accepted names.
"""

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def register(registry: dict[str, F], name: str, kind: str) -> Callable[[F], F]:
    """Return a decorator that adds a function to ``registry`` under ``name``.

    Raises ``ValueError`` if ``name`` is already taken, so two modules cannot silently shadow
    each other; remove the old entry from the dict first to replace it on purpose.
    """

    def decorator(fn: F) -> F:
        if name in registry:
            raise ValueError(f"{kind} {name!r} is already registered")
        registry[name] = fn
        return fn

    return decorator


def lookup(registry: dict[str, F], name: str, kind: str) -> F:
    """Return ``registry[name]``, or raise ``ValueError`` naming the accepted names.

    A name not registered yet may be a plugin's: the modules of ``clew.envs.plugins``
    (entry points, ``CLEW_ENV_MODULES``) are imported once before the name is refused, so a
    Ray worker finds what the driver's config named.
    """
    if name not in registry:
        from clew.envs.plugins import load_plugins

        load_plugins()
    try:
        return registry[name]
    except KeyError:
        accepted = ", ".join(repr(k) for k in sorted(registry))
        raise ValueError(f"unknown {kind} {name!r}; accepted: {accepted}") from None
