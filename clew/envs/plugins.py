"""Environments registered outside clew: installed plugins and modules named in the config.

An env registers itself when its module is imported (``clew.envs.register``). clew imports:

- every entry point of the ``clew.envs`` group, so an installed package that declares one
  (``[project.entry-points."clew.envs"] my_envs = "my_package.envs"``) is known to every
  clew command with no config, as Gymnasium's ``gymnasium.envs`` plugins are;
- the modules listed in ``environment.modules`` (a module of the current directory, or of
  an installed package), which a run passes to its Ray workers' processes in the
  ``CLEW_ENV_MODULES`` environment variable (``modules_env``), so rollouts on every node
  know the envs the driver knows.

Both load once per process, on the first lookup in the registry. A module that fails to
import is an ``EnvError`` naming it and the cause.

A run resolves every env id of its data before its first step, in the driver
(``check_env_ids``) and in each of its workers (``unresolved_env_ids``, through the worker
group's ``check_envs``): an env registered only in the driver's process (by a script's own
``register`` call) is unknown to a Ray worker, whose every episode would otherwise end as
``env_error`` and leave the run nothing to learn from.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable, Sequence
from importlib.metadata import entry_points

from clew.errors import EnvError

ENTRY_POINT_GROUP = "clew.envs"
MODULES_VAR = "CLEW_ENV_MODULES"
REGISTER_HINT = (
    "register it with clew.envs.register in a module named in environment.modules (the "
    "driver and every Ray worker import those), or in an installed package that declares "
    f"the module as an entry point of the {ENTRY_POINT_GROUP!r} group"
)

_loaded: set[str] = set()
_entry_points_loaded = False


def import_env_modules(modules: Sequence[str]) -> None:
    """Import ``modules`` (once each), the current directory importable as for ``python -m``."""
    for name in modules:
        if name in _loaded:
            continue
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            importlib.import_module(name)
        except Exception as e:
            raise EnvError(
                f"could not import environment module {name!r} (environment.modules): "
                f"{type(e).__name__}: {e}; give a module of the current directory or of an "
                "installed package, as for `python -c 'import NAME'`"
            ) from e
        _loaded.add(name)


def load_plugins() -> None:
    """Import the ``clew.envs`` entry points and the modules in ``CLEW_ENV_MODULES``."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                loaded = ep.load()
            except Exception as e:
                raise EnvError(
                    f"the installed environment plugin {ep.name!r} ({ep.value}, entry point "
                    f"group {ENTRY_POINT_GROUP!r}) failed to import: {type(e).__name__}: {e}"
                ) from e
            if callable(loaded):  # an entry point may name a function that registers
                loaded()
    named = [m for m in os.environ.get(MODULES_VAR, "").split(",") if m.strip()]
    import_env_modules([m.strip() for m in named])


def modules_env(modules: Sequence[str]) -> dict[str, str]:
    """Environment variables that make a worker process import ``modules`` as this one
    does: their names, and the current directory on the import path."""
    if not modules:
        return {}
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    return {MODULES_VAR: ",".join(modules), "PYTHONPATH": path}


def unresolved_env_ids(env_ids: Iterable[str]) -> dict[str, str]:
    """The ids of ``env_ids`` this process cannot build an env for, each with why (its
    plugins loaded first): an empty dict when every one is registered here."""
    from clew.envs.base import spec

    missing: dict[str, str] = {}
    for env_id in sorted(set(env_ids)):
        try:
            spec(env_id)
        except EnvError as exc:
            missing[env_id] = str(exc)
    return missing


def check_env_ids(env_ids: Iterable[str], where: str = "the run's data") -> None:
    """Raise an ``EnvError`` naming the first id of ``env_ids`` (found in ``where``) that
    is registered nowhere this process looks, and how to register it."""
    missing = unresolved_env_ids(env_ids)
    if missing:
        env_id, why = next(iter(missing.items()))
        others = f" (unregistered too: {', '.join(map(repr, list(missing)[1:]))})"
        raise EnvError(
            f"environment id {env_id!r} of {where} is not registered: {why}. To train on it, "
            f"{REGISTER_HINT}" + (others if len(missing) > 1 else "")
        )
