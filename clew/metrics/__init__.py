"""Training metrics: collect a step's numbers, log them, read the history back, plot it.

The trainer hands values to a :class:`MetricsCollector` instead of doing its own bookkeeping,
flushes one flat ``dict[str, float]`` per step to the loggers from :func:`make_loggers`
(``metrics.jsonl`` always among them, as the run's record; ``ray`` too when the run uses
Ray, :mod:`clew.metrics.ray_metrics`), and tools read that file back with
:func:`read_history`, :func:`draw_report` and :func:`summarize`. What each metric name means is
documented once, in :mod:`clew.metrics.catalog`.

matplotlib, torch's tensorboard writer, wandb and mlflow are imported only when used, so
importing this package costs little.
"""

from clew.metrics.catalog import (
    CATALOG,
    TIMING_PHASES,
    MetricSpec,
    catalog_markdown,
    describe,
)
from clew.metrics.collector import NON_FINITE_KEY, MetricsCollector
from clew.metrics.history import METRICS_FILE, read_history, truncate_history
from clew.metrics.loggers import (
    LOGGERS,
    LoggerContext,
    MetricsLogger,
    MultiLogger,
    make_loggers,
    register_logger,
)
from clew.metrics.ray_metrics import exported_name, ray_metric_name, with_ray_metrics
from clew.metrics.report import draw_report, summarize

__all__ = [
    "CATALOG",
    "LOGGERS",
    "METRICS_FILE",
    "NON_FINITE_KEY",
    "TIMING_PHASES",
    "LoggerContext",
    "MetricSpec",
    "MetricsCollector",
    "MetricsLogger",
    "MultiLogger",
    "catalog_markdown",
    "describe",
    "draw_report",
    "exported_name",
    "make_loggers",
    "ray_metric_name",
    "read_history",
    "register_logger",
    "summarize",
    "truncate_history",
    "with_ray_metrics",
]
