"""Progress lines for long phases (rollouts, evaluations), readable in a log file.

A run's console goes to a terminal, to a log file, or to a Ray job's logs (the Ray dashboard
shows a job driver's stdout). A bar redrawn with carriage returns turns into one long line in
a file, so :class:`Progress` writes whole lines when the stream is not a terminal::

    step 3 generate: 96/192 episodes, <seconds since the phase began> s

at most one every ``every_s`` seconds, plus a final one when the phase ends. A phase shorter
than ``every_s`` prints nothing: the step's own metrics line already says how long it took.
On a terminal the same text is redrawn in place and ends with a newline.

transformers draws tqdm bars of its own while it loads and saves weights ("Loading
weights", "Writing model shards"): redrawn with carriage returns, every load and export
leaves a run's log file or ``ray job logs`` one long line of them. ``library_bars_off``
turns them off; a run keeps them only where its stderr is a terminal
(``library_bars_unless_tty``), and Ray workers, which have none, never draw them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

EVERY_S = 5.0


class Progress:
    """Counts finished items of one phase; called with how many just finished.

    ``enabled=False`` keeps it silent (a run without the console logger). ``every_s`` is
    ``EVERY_S`` when not given; ``stream`` is ``sys.stdout``, looked up when a line is
    written.
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "episodes",
        enabled: bool = True,
        every_s: float | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.enabled = enabled
        self.every_s = EVERY_S if every_s is None else every_s
        self.stream, self.clock = stream, clock
        self.done = 0
        self.started = clock()
        self.last_line: float | None = None  # when the latest line was written
        self.lines = 0

    def __call__(self, finished: int) -> None:
        self.done += finished
        now = self.clock()
        since = now - (self.last_line if self.last_line is not None else self.started)
        if self.enabled and since >= self.every_s and self.done < self.total:
            self._write(now, final=False)

    def close(self) -> None:
        """The final line, for a phase that lasted ``every_s`` or more."""
        now = self.clock()
        if self.enabled and (self.lines or now - self.started >= self.every_s):
            self._write(now, final=True)

    def line(self, now: float | None = None) -> str:
        elapsed = (self.clock() if now is None else now) - self.started
        return f"{self.label}: {self.done}/{self.total} {self.unit}, {elapsed:.1f} s"

    def _write(self, now: float, final: bool) -> None:
        out = self.stream if self.stream is not None else sys.stdout
        text = self.line(now)
        if getattr(out, "isatty", lambda: False)():
            # Redrawn in place; the ANSI erase clears what a longer earlier line left.
            out.write("\r" + text + "\x1b[K" + ("\n" if final else ""))
        else:
            out.write(text + "\n")
        out.flush()
        self.last_line, self.lines = now, self.lines + 1

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def library_bars_off() -> None:
    """Turn off transformers' progress bars (weight loading and saving) in this process."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


@contextmanager
def library_bars_unless_tty(stream: TextIO | None = None) -> Iterator[None]:
    """Inside: transformers' progress bars only when ``stream`` (``sys.stderr``, where they
    are drawn) is a terminal; as they were after."""
    from transformers.utils import logging as hf_logging

    out = stream if stream is not None else sys.stderr
    was_on = hf_logging.is_progress_bar_enabled()
    if was_on and not getattr(out, "isatty", lambda: False)():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
