"""Trajectory records on disk: one JSON object per line, enough to replay and inspect an episode.

A record holds at least ``env_id``, ``env_options``, ``seed`` and ``actions`` (the reply
texts, in order); rollouts add rewards, turns and token counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clew.errors import DataError

REQUIRED = ("env_id", "env_options", "seed", "actions")


def read_trajectory_line(path: str | Path, index: int) -> dict[str, Any]:
    """Record number ``index`` (0-based) of a trajectories JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"trajectory file {path} does not exist")
    count = 0
    with path.open() as f:
        for i, line in enumerate(f):
            count = i + 1
            if i == index:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path} line {i + 1} is not JSON: {exc}") from None
                missing = [k for k in REQUIRED if k not in rec]
                if missing:
                    raise DataError(f"{path} line {i + 1} lacks {', '.join(missing)}")
                return rec
    raise DataError(f"{path} has no line {index} (it has {count} lines)")
