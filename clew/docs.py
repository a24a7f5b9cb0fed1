"""The generated reference pages (configuration keys, metric names), kept in ``docs/``."""

from __future__ import annotations

from pathlib import Path


def config_page() -> str:
    from clew.config import schema_markdown

    return (
        "# Configuration reference\n\nGenerated from the schema (`clew/config/schema.py`) by "
        "`make docs`; every key takes a dotted `key=value` override on `clew train`.\n\n"
        + schema_markdown()
        + "\n"
    )


def metrics_page() -> str:
    from clew.metrics import catalog_markdown

    return (
        "# Metrics\n\nGenerated from `clew/metrics/catalog.py` by `make docs`.\n\n"
        + catalog_markdown()
        + "\n"
    )


def write_docs(folder: str | Path) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.md").write_text(config_page())
    (folder / "metrics.md").write_text(metrics_page())
