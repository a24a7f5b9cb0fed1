"""Config values that name something: each must be registered (advantage estimators, policy
losses, KL estimators, loggers) or resolve for the run's env (prompt formats).

Part of ``clew.config.validate``'s pass: each check reports through its ``fail(rule,
message)`` and names what is accepted and the nearest match.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from clew.config.schema import KNOWN_LOGGERS, ClewConfig


def registered(
    registry: dict[str, Any],
    key: str,
    name: str,
    kind: str,
    how: str,
    fail: Callable[[str, str], None],
    aliases: tuple[str, ...] = (),
) -> bool:
    """Whether ``name`` (the value of ``key``) is in ``registry`` or ``aliases``; if not, a
    failure naming the registered ones, the nearest and how to register another."""
    if name in registry or name in aliases:
        return True
    from clew.envs.plugins import load_plugins

    load_plugins()  # installed plugins' entry points may register it
    if name in registry:
        return True
    names = sorted([*registry, *aliases])
    near = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else "."
    fail(
        kind.replace(" ", "-"),
        f"{key} {name!r} is not a registered {kind} (registered: "
        f"{', '.join(repr(k) for k in names)}){hint} Register another with {how} in a module "
        "named in environment.modules.",
    )
    return False


def registered_estimator(name: str, fail: Callable[[str, str], None]) -> Any:
    """The registered estimator ``name`` (an ``EstimatorSpec``), or None after a failure
    naming the registered ones and the nearest."""
    # Imported here: the registry pulls in torch, which reading a config does not need.
    from clew.algorithms.estimators import ADVANTAGE_ESTIMATORS

    key, how = "trainer.algorithm.advantage_estimator", "clew.algorithms.register_estimator"
    if registered(ADVANTAGE_ESTIMATORS, key, name, "advantage estimator", how, fail):
        return ADVANTAGE_ESTIMATORS[name]
    return None


def named_functions(cfg: ClewConfig, fail: Callable[[str, str], None]) -> None:
    """The policy loss, KL estimator and loggers the config names are registered."""
    from clew.algorithms import KL_ESTIMATORS, POLICY_LOSSES
    from clew.algorithms.losses import LOSS_ALIASES
    from clew.metrics.loggers import LOGGERS

    alg, tr = cfg.trainer.algorithm, cfg.trainer
    key = "trainer.algorithm.policy_loss_type"
    how = "clew.algorithms.register_policy_loss"
    registered(POLICY_LOSSES, key, alg.policy_loss_type, "policy loss", how, fail, (*LOSS_ALIASES,))
    key, how = "trainer.algorithm.kl_estimator_type", "clew.algorithms.register_kl_estimator"
    registered(KL_ESTIMATORS, key, alg.kl_estimator_type, "KL estimator", how, fail)
    if not tr.logger_names:
        fail("logger", f"trainer.logger names no logger; accepted: {', '.join(KNOWN_LOGGERS)}")
    for name in tr.logger_names:
        registered(LOGGERS, "trainer.logger", name, "logger", "clew.metrics.register_logger", fail)


def check_prompt_format(env_id: str, fmt: Any, fail: Callable[[str, str], None]) -> None:
    """The format must resolve and render for the run's env (its templates, its parser)."""
    from clew.envs import make, spec
    from clew.errors import EnvError

    try:
        if "prompt_format" not in spec(env_id).accepted_options:
            fail(
                "prompt-format",
                f"environment.prompt_format is set but {env_id!r} (environment.env_id) has no "
                "prompt formats",
            )
            return
        make(env_id, prompt_format=fmt)
    except EnvError as exc:
        fail("prompt-format", f"environment.prompt_format: {exc}")
