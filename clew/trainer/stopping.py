"""A graceful stop: SIGINT or SIGTERM ends a run at the next step boundary, saved.

Used by `clew train` (a checkpoint and an export of the step reached) and `clew sft`
(evaluated and saved as after its last step).

Ctrl-C, `timeout`, a scheduler's preemption or `kill` used to drop whatever the run had
done since its last checkpoint (up to ``ckpt_interval - 1`` steps, and the export of the
newest policy). With ``GracefulStop`` around the loop the first signal only sets
``requested``: the step in flight finishes, the loop writes a checkpoint and an export
and returns. A second signal raises ``KeyboardInterrupt`` at once, for a step that will
not finish. This is what PyTorch Lightning does on SIGTERM and Hugging Face Trainer's
``should_training_stop`` does between steps; neither is a dependency of clew's loop, so the
few lines are written here.

Handlers can only be installed from the main thread; elsewhere (a loop run in a worker
thread) the stop is inert and signals keep their old meaning.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any, ClassVar

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """Context manager: ``requested`` turns true on the first SIGINT/SIGTERM inside it."""

    # Stops requested in this process, over every GracefulStop: a caller that runs several
    # loops one after another (a sweep, ``clew.trainer.sweep``) compares it before and after
    # one to tell a loop that was stopped from one that ended.
    stops: ClassVar[int] = 0

    def __init__(self, what: str = "the run") -> None:
        self.what = what
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        GracefulStop.stops += 1
        self.signal_name = signal.Signals(signum).name
        print(
            f"{self.signal_name}: {self.what} stops after the step in progress and saves "
            "(send it again to stop at once, unsaved)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
