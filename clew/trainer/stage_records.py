"""The record of a pipeline's finished stages: ``LOG/stages.json``.

Each stage that finishes records the settings it was made from (``record``), so that a
later run of the same chain can tell whether the stage's output is already there from the
same settings (``finished``: skip it), from other settings (an error naming what differs),
or not at all (make it). A stage's settings are the config keys it depends on
(``section_settings``) and what the earlier stages of the chain were made from
(``upstream``). Records are written whole (``write_json``), never half.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clew.config import ClewConfig
from clew.errors import ConfigError

STAGES_FILE = "stages.json"


def _records(out: Path) -> dict[str, Any]:
    path = out / STAGES_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def finished(out: Path, stage: str, settings: dict[str, Any], output: str, present: bool) -> bool:
    """True when ``stage``'s ``output`` is ``present`` and was made from ``settings``.

    ``settings`` maps config keys to the values the stage depends on. Output made from
    other settings is an error naming each key that differs. Absent output, or output
    without a record (a stage interrupted before it finished), is made again.
    """
    done = _records(out).get(stage)
    if not present or done is None:
        return False
    if done["settings"] != settings:
        keys = sorted(set(done["settings"]) | set(settings))
        diffs = [
            f"{k}: {done['settings'].get(k)!r} there, {settings.get(k)!r} now"
            for k in keys
            if done["settings"].get(k) != settings.get(k)
        ]
        raise ConfigError(
            f"the '{stage}' stage's output {output} was made from other settings:\n  "
            + "\n  ".join(diffs)
            + f"\nuse another trainer.log_path (--output-dir), or delete {output} to make "
            "it again"
        )
    return True


def section_settings(prefix: str, section: Any) -> dict[str, Any]:
    """A config section's values keyed by their dotted config keys (``prefix.key``)."""
    return {f"{prefix}.{k}": v for k, v in section.model_dump(mode="json").items()}


def upstream(cfg: ClewConfig, out: Path, stages: tuple[str, ...]) -> dict[str, Any]:
    """What earlier stages of this chain were made from: a change there makes this stale."""
    records = _records(out)
    return {
        f"stages.{name}": records[name]["settings"] if name in cfg.pipeline.stages else None
        for name in stages
    }


def record(out: Path, stage: str, settings: dict[str, Any], **made: Any) -> None:
    """Records ``stage`` as finished, made from ``settings``, with what it ``made``."""
    records = _records(out)
    records[stage] = {"settings": settings, **made}
    write_json(out / STAGES_FILE, records)


def write_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON at ``path``, written whole (a temporary file renamed over it),
    so a record on disk is never half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
