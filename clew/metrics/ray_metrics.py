"""Training metrics through Ray's metrics API, so Prometheus scrapes them beside Ray's own.

The ``ray`` logger keeps one Ray gauge (``ray.util.metrics.Gauge``) per clew metric, named by
:func:`ray_metric_name` (``train/solve_rate`` becomes ``clew_train_solve_rate``) and tagged
with the run's ``project`` and ``run``; ``clew_step`` is the step of the latest values. Ray
sends a process's metrics to its node's metrics agent, which serves them with Ray's own on the
node's metrics export port (``ray start --metrics-export-port=8080``, or
``ray.init(_metrics_export_port=...)``), every name prefixed with ``ray_``
(:func:`exported_name`: ``ray_clew_train_solve_rate``). ``deploy/grafana/`` has a dashboard
for these series.

When it is on: whenever the run uses Ray, that is with more than one policy worker or with
``RAY_ADDRESS`` set (a ``ray job submit`` entrypoint has it), :func:`with_ray_metrics` adds it
to the run's loggers, as ``jsonl`` is always added. It can also be named in
``trainer.logger``; a run that does not use Ray then fails at start-up saying so. A run with
one worker and ``RAY_ADDRESS`` set joins that cluster for its metrics (and leaves it when the
logger closes).

Why values are sent again: Ray's agent drops a gauge whose value has not been reported for two
report intervals (``RAY_metrics_report_interval_ms``, 10 s by default), and a process reports a
gauge only in the interval it was set. A training step often takes longer than that, so while
the logger is open a thread sets every metric's latest value again every half interval:
Prometheus sees the last value of each series between steps and between evaluations, as with
any gauge. After the logger closes, the last values stay for two report intervals.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable
from typing import Any

from clew.errors import ClewError, ConfigError
from clew.metrics.catalog import describe
from clew.metrics.loggers import LoggerContext, register_logger
from clew.ray_connect import join_ray

log = logging.getLogger(__name__)

NAME = "ray"
PREFIX = "clew_"
# Ray's metrics agent puts this in front of every name a process sets.
EXPORT_PREFIX = "ray_"
STEP = "step"
TAG_KEYS = ("project", "run")
# Ray's config variables are RAY_ and the key in Ray's own case.
REPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"
# Ray's default report interval, and the floor its exporter applies.
DEFAULT_REPORT_INTERVAL_MS = 10_000
MIN_REPORT_INTERVAL_MS = 1_000

_UNSAFE = re.compile(r"[^a-zA-Z0-9_]+")

NOT_ON_RAY = (
    "trainer.logger names 'ray', but this run does not use Ray: it has one policy worker in "
    "this process and RAY_ADDRESS is unset. The ray logger is on by itself when a run uses "
    "Ray (trainer.placement.num_cpu_workers > 1, GPU workers, or RAY_ADDRESS naming a cluster "
    "to join); otherwise drop it from trainer.logger"
)


def ray_metric_name(name: str) -> str:
    """The Ray metric name of clew metric ``name``: ``clew_`` and the name with every run of
    characters Prometheus does not allow as ``_`` (``timing/generate`` ->
    ``clew_timing_generate``)."""
    return PREFIX + _UNSAFE.sub("_", name).strip("_")


def exported_name(name: str) -> str:
    """The name Prometheus scrapes for clew metric ``name`` (``ray_clew_train_solve_rate``)."""
    return EXPORT_PREFIX + ray_metric_name(name)


def _ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def _ray_running_here() -> bool:
    """Ray already started or joined in this process (checked without importing it)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def uses_ray(num_workers: int) -> bool:
    """Whether a run with ``num_workers`` policy workers runs on Ray: several workers are Ray
    actors, and with ``RAY_ADDRESS`` set the run joins that cluster."""
    return num_workers > 1 or (bool(os.environ.get("RAY_ADDRESS")) and _ray_installed())


def with_ray_metrics(names: str | Iterable[str], num_workers: int) -> list[str]:
    """The loggers a run of ``num_workers`` policy workers gets: ``names`` plus ``ray`` when
    the run uses Ray. ``ray`` named by a run without Ray raises ``ConfigError``, so call this
    before any model loads."""
    listed = [n.strip().lower() for n in (names.split(",") if isinstance(names, str) else names)]
    listed = [n for n in listed if n]
    on_ray = uses_ray(num_workers)
    if NAME in listed and not (on_ray or _ray_running_here()):
        raise ConfigError(NOT_ON_RAY)
    if on_ray and NAME not in listed:
        listed.append(NAME)
    return listed


def _report_interval_s() -> float:
    """Ray's metrics report interval in this process, in seconds."""
    try:  # the interval the cluster runs with, once Ray is up here
        import ray

        ms = int(ray._config.metrics_report_interval_ms())
    except Exception:
        ms = int(os.environ.get(REPORT_INTERVAL_ENV, DEFAULT_REPORT_INTERVAL_MS))
    return max(ms, MIN_REPORT_INTERVAL_MS) / 1000


@register_logger(NAME)
class RayMetricsLogger:
    """Each metric as a Ray gauge tagged with the run's project and name (see the module)."""

    def __init__(self, ctx: LoggerContext, *, refresh_s: float | None = None) -> None:
        if not _ray_installed():
            raise ConfigError(
                "logger 'ray' needs Ray, which is not installed: pip install 'clew[ray]'"
            )
        import ray

        self.owns_ray = False
        if not ray.is_initialized():
            if not (address := os.environ.get("RAY_ADDRESS")):
                raise ConfigError(NOT_ON_RAY)
            try:  # the run's job was submitted to a cluster: report to it
                join_ray(address)
            except ClewError as e:  # an address that does not answer: say which
                raise ConfigError(f"logger 'ray': {e}") from e
            self.owns_ray = True
        self.tags = {"project": ctx.project_name, "run": ctx.run_name}
        self._gauges: dict[str, Any] = {}  # clew name -> gauge; None for a name not sent
        self._sources: dict[str, str] = {}  # Ray name -> clew name, to catch two sharing one
        self._latest: dict[str, float] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        period = refresh_s if refresh_s is not None else min(_report_interval_s() / 2, 5.0)
        self._thread = threading.Thread(
            target=self._refresh, args=(period,), name="clew-ray-metrics", daemon=True
        )
        self._thread.start()

    def _gauge(self, name: str) -> Any:
        if name in self._gauges:
            return self._gauges[name]
        from ray.util.metrics import Gauge

        ray_name = ray_metric_name(name)
        other = self._sources.setdefault(ray_name, name)
        if other != name:
            log.warning(
                "metric %r is not sent to Ray: its name %r is taken by %r", name, ray_name, other
            )
            gauge = None
        else:
            meaning = describe(name) or (
                "Global step of the latest values." if name == STEP else f"clew metric {name}"
            )
            gauge = Gauge(ray_name, description=meaning, tag_keys=TAG_KEYS)
            gauge.set_default_tags(self.tags)
        self._gauges[name] = gauge
        return gauge

    def log(self, metrics: dict[str, float], step: int) -> None:
        values = {STEP: float(step), **{k: float(v) for k, v in metrics.items() if k != STEP}}
        with self._lock:
            for name, value in values.items():
                gauge = self._gauge(name)
                if gauge is not None:
                    gauge.set(value)
                    self._latest[name] = value

    def _refresh(self, period: float) -> None:
        while not self._closed.wait(period):
            try:
                with self._lock:
                    for name, value in self._latest.items():
                        self._gauges[name].set(value)
            except Exception:  # Ray went away under the run: its metrics went with it
                log.warning("stopped re-sending metrics to Ray", exc_info=True)
                return

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        if self.owns_ray:
            import ray

            ray.shutdown()
