"""Name -> function registries: advantage estimators, losses, KL estimators, loggers.

Advantage estimators, policy losses and KL estimators are chosen by a name in the config
(SkyRL-style ``trainer.algorithm.*`` values). A plain dict plus a decorator keeps adding one a
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
    """Return ``registry[name]``, or raise ``ValueError`` naming the accepted names."""
    try:
        return registry[name]
    except KeyError:
        accepted = ", ".join(repr(k) for k in sorted(registry))
        raise ValueError(f"unknown {kind} {name!r}; accepted: {accepted}") from None
