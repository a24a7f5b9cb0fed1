"""Metric loggers, chosen by name: ``console``, ``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``
and ``ray`` (Ray's metrics API, for Prometheus; :mod:`clew.metrics.ray_metrics`).

A logger is anything with ``log(metrics, step)`` and ``close()`` (:class:`MetricsLogger`);
there is no base class to inherit. Loggers are built by factories registered under the name a
config uses (``trainer.logger: [console, tensorboard]``); add one with
``@register_logger("name")`` on a class or function taking a :class:`LoggerContext`.

``jsonl`` is always on, whatever the config lists: ``<run_dir>/metrics.jsonl`` is the run's
record, which resuming (:func:`~clew.metrics.history.truncate_history`), reports
(:mod:`clew.metrics.report`) and comparisons read back, so a run logged only to a remote
dashboard would still have a local history.

``wandb`` and ``mlflow`` are optional packages, imported only when chosen; choosing one that
is not installed fails at start-up with the ``pip install`` to run, not at the first step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from clew.errors import ConfigError
from clew.metrics.catalog import HEADLINE
from clew.metrics.history import history_path, repair_tail
from clew.registry import register

log = logging.getLogger(__name__)


@runtime_checkable
class MetricsLogger(Protocol):
    """What the trainer needs from a logger."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LoggerContext:
    """Everything a logger factory may need about the run."""

    run_dir: Path
    project_name: str
    run_name: str
    # The resolved run config, for loggers that record hyperparameters.
    config: dict[str, Any] | None = None


LoggerFactory = Callable[[LoggerContext], MetricsLogger]
FactoryT = TypeVar("FactoryT", bound=LoggerFactory)

LOGGERS: dict[str, LoggerFactory] = {}
ALWAYS_ON = "jsonl"


def register_logger(name: str) -> Callable[[FactoryT], FactoryT]:
    """Decorator registering a logger factory under ``name``; duplicate names are an error."""

    return register(LOGGERS, name, "logger")


def format_value(value: float) -> str:
    """Compact number for a console line: integers bare, others with 4 significant digits."""
    if not math.isfinite(value):
        return str(value)
    if value == int(value) and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.4g}"


@register_logger("console")
class ConsoleLogger:
    """One compact line per step through ``logging``; the full dict when asked for.

    The line shows the catalog's headline metrics present this step (reward, solve rate,
    eval, loss, KL, ...). The full sorted dict is logged at DEBUG every step, and at INFO every
    ``full_every`` steps so a plain INFO log still has the whole picture now and then.
    """

    def __init__(self, ctx: LoggerContext | None = None, *, full_every: int = 50) -> None:
        self.full_every = full_every
        self.logger = logging.getLogger("clew.metrics.console")
        if not self.logger.hasHandlers():
            # Nothing configured logging (library use, a notebook): without a handler of our
            # own the INFO lines would be dropped and "console" would print nothing.
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            self.logger.addHandler(handler)
            self.logger.setLevel(logging.INFO)

    def log(self, metrics: dict[str, float], step: int) -> None:
        parts = [f"step {step}"]
        parts += [
            f"{spec.short} {format_value(metrics[spec.name])}"
            for spec in HEADLINE
            if spec.name in metrics
        ]
        bad = metrics.get("metrics/non_finite", 0)
        if bad:
            parts.append(f"NON-FINITE {format_value(bad)}")
        self.logger.info(" | ".join(parts))
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug(self._full(metrics, step))
        elif self.full_every > 0 and step % self.full_every == 0:
            self.logger.info(self._full(metrics, step))

    @staticmethod
    def _full(metrics: Mapping[str, float], step: int) -> str:
        width = max((len(k) for k in metrics), default=0)
        rows = [f"  {k:<{width}}  {format_value(v)}" for k, v in sorted(metrics.items())]
        return f"step {step}, all metrics:\n" + "\n".join(rows)

    def close(self) -> None:
        pass


@register_logger("jsonl")
class JsonlLogger:
    """Appends ``{"step": s, ...}`` to ``<run_dir>/metrics.jsonl``, one flushed line per step.

    Appends rather than truncates, so a resumed run continues its history (trim it first with
    ``truncate_history``); a partial line left by a killed process is cut before appending.
    The file is opened for each line rather than held open: ``truncate_history`` replaces
    the file on resume, and a handle held from before would write into the replaced one.
    """

    def __init__(self, ctx: LoggerContext) -> None:
        self.path = history_path(ctx.run_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_tail(self.path)

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items() if k != "step"}}
        # One write per line, flushed on close: after a crash the history reaches the last
        # completed step.
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


@register_logger("tensorboard")
class TensorBoardLogger:
    """Scalars into ``<run_dir>/tensorboard`` via torch's ``SummaryWriter``."""

    def __init__(self, ctx: LoggerContext) -> None:
        # Imported here: torch and tensorboard are slow to import and only this logger needs them.
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(ctx.run_dir / "tensorboard"))
        if ctx.config:
            text = json.dumps(ctx.config, indent=2, sort_keys=True, default=str)
            # Indented 4 spaces: TensorBoard renders text as Markdown, this keeps it verbatim.
            self.writer.add_text("config", "    " + text.replace("\n", "\n    "))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
        # The default 2-minute flush would hide the latest steps from a live dashboard.
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _import_optional(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"logger {module!r} needs the {module} package, which is not installed: "
            f"pip install {module}"
        ) from None


@register_logger("wandb")
class WandbLogger:
    """Weights & Biases run named after the clew run, in project ``project_name``."""

    def __init__(self, ctx: LoggerContext) -> None:
        wandb = _import_optional("wandb")
        self.run = wandb.init(
            project=ctx.project_name,
            name=ctx.run_name,
            config=ctx.config,
            dir=str(ctx.run_dir),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            # MLflow rejects parameter values longer than 500 characters.
            out[name] = str(value)[:500]
    return out


@register_logger("mlflow")
class MlflowLogger:
    """MLflow run ``run_name`` in experiment ``project_name`` (tracking URI from the env)."""

    def __init__(self, ctx: LoggerContext) -> None:
        self.mlflow = _import_optional("mlflow")
        self.mlflow.set_experiment(ctx.project_name)
        self.run = self.mlflow.start_run(run_name=ctx.run_name)
        if ctx.config:
            params = list(_flatten(ctx.config).items())
            # log_params is limited to 100 parameters per call.
            for i in range(0, len(params), 100):
                self.mlflow.log_params(dict(params[i : i + 100]))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class MultiLogger:
    """Fans each step out to several loggers; what :func:`make_loggers` returns."""

    def __init__(self, loggers: Mapping[str, MetricsLogger]) -> None:
        self.loggers = dict(loggers)

    @property
    def names(self) -> list[str]:
        return list(self.loggers)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        for logger in self.loggers.values():
            logger.log(metrics, step)

    def close(self) -> None:
        """Close every logger, even if one fails (then re-raise the first error)."""
        first: BaseException | None = None
        for name, logger in self.loggers.items():
            try:
                logger.close()
            except Exception as err:
                log.exception("closing logger %r failed", name)
                first = first or err
        if first is not None:
            raise first

    def __enter__(self) -> MultiLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse_names(names: str | Iterable[str]) -> list[str]:
    if isinstance(names, str):
        # "console,tensorboard" from a CLI flag is as valid as a list from YAML.
        names = names.split(",")
    out = [ALWAYS_ON]
    for raw in names:
        name = raw.strip().lower()
        if name and name not in out:
            out.append(name)
    unknown = [n for n in out if n not in LOGGERS]
    if unknown:
        accepted = ", ".join(sorted(LOGGERS))
        raise ConfigError(f"unknown logger {unknown[0]!r}; accepted: {accepted}")
    return out


def make_loggers(
    names: str | list[str],
    run_dir: str | os.PathLike[str],
    project_name: str,
    run_name: str,
    config: dict[str, Any] | None = None,
) -> MultiLogger:
    """Build the named loggers (plus ``jsonl``, always) for one run.

    ``names`` is a list or a comma-separated string. Unknown names raise ``ConfigError``
    listing the accepted ones, before any logger is created; if one fails to start, those
    already started are closed again.
    """
    ordered = _parse_names(names)
    ctx = LoggerContext(Path(run_dir), project_name, run_name, config)
    built: dict[str, MetricsLogger] = {}
    try:
        for name in ordered:
            built[name] = LOGGERS[name](ctx)
    except BaseException:
        # The start-up error is the one to report, not a secondary failure while closing.
        with contextlib.suppress(Exception):
            MultiLogger(built).close()
        raise
    return MultiLogger(built)
