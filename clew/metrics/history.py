"""Reading and trimming a run's metric history, ``<run_dir>/metrics.jsonl``.

The JSONL file is the run's record: one ``{"step": s, "name": value, ...}`` object per line,
appended and flushed as each step is logged (by the always-on ``jsonl`` logger). Two things
happen to such a file in practice, and both are handled here:

* The process is killed mid-write, leaving a partial last line. :func:`read_history`
  ignores it (with a warning) instead of refusing the whole run; a broken line *before* the
  last is real corruption and raises :class:`~clew.errors.DataError`.
* A run resumes from a checkpoint older than the last logged step. The steps after the
  checkpoint will be logged again, so :func:`truncate_history` drops them first and the file
  never holds two records for one step.

Values are written with Python's ``json`` defaults, so a NaN metric is the token ``NaN``
(which Python reads back; strict JSON parsers do not). Keeping it beats replacing it: a NaN
is the record of a run going wrong.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from clew.errors import DataError

METRICS_FILE = "metrics.jsonl"

log = logging.getLogger(__name__)


def history_path(run_dir: str | os.PathLike[str]) -> Path:
    """Where a run's metric history lives."""
    return Path(run_dir) / METRICS_FILE


def _read_text(path: Path) -> str:
    # A kill can also cut a multi-byte character in half; only that partial line is affected.
    return path.read_text(encoding="utf-8", errors="replace")


def _parse_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(raw line, record)`` for each complete line; a broken final line is skipped."""
    text = _read_text(path)
    lines = text.split("\n")
    last = max((i for i, line in enumerate(lines, start=1) if line.strip()), default=0)
    out: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError("not an object with a 'step' key")
        except ValueError as err:
            # Only the final line can be cut short by a kill; the logger flushes whole lines.
            if number == last:
                log.warning("%s: ignoring a truncated last line (%d chars)", path, len(line))
                break
            raise DataError(f"{path}, line {number}: not a metrics record ({err})") from None
        out.append((line, record))
    return out


def read_history(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All logged records of a run, in file order; ``[]`` if nothing was logged yet.

    Raises ``DataError`` if ``run_dir`` is not a directory (a mistyped path should not read
    as an empty run) or a line other than the last is not a metrics record.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"run directory {str(run_dir)!r} does not exist")
    path = history_path(run_dir)
    if not path.is_file():
        return []
    return [record for _, record in _parse_lines(path)]


def truncate_history(run_dir: str | os.PathLike[str], step: int) -> int:
    """Drop records with ``step`` greater than ``step`` (and any partial last line).

    Call when resuming from the checkpoint of ``step``, before logging again. The file is
    rewritten atomically (temp file + rename), so a crash here cannot lose the history.
    Returns the number of records dropped; a missing file is a no-op.
    """
    path = history_path(run_dir)
    if not path.is_file():
        return 0
    entries = _parse_lines(path)
    kept = [line for line, record in entries if record["step"] <= step]
    dropped = len(entries) - len(kept)
    new_text = "".join(line + "\n" for line in kept)
    if new_text == _read_text(path):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new_text, encoding="utf-8")
    os.replace(tmp, path)
    if dropped:
        log.info("%s: dropped %d records after step %d", path, dropped, step)
    return dropped


def repair_tail(path: Path) -> None:
    """Cut a partial last line so that appending starts on a fresh line.

    Without this, the first record appended after a crash would be glued onto the fragment
    and turn a harmless truncated tail into a corrupt line in the middle of the file.
    """
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        data_len = f.seek(0, os.SEEK_END)
        # Partial lines are short, but scan back in blocks so a long one cannot defeat us.
        pos, block = data_len, 4096
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            pos = start
        else:
            keep = 0
        log.warning("%s: cutting a partial last line (%d bytes)", path, data_len - keep)
        f.truncate(keep)
