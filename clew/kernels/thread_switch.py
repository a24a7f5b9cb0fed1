"""A switch that is on for a block of code, in the thread that runs it.

The engine turns model-side fast paths on for its own forwards only (``fused_pointwise``,
``clew.models.distinct_images``), while the trainer's forwards of the same model, perhaps in
another thread, keep transformers' code.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class ThreadSwitch:
    """Off unless inside ``block(True)`` in this thread; blocks nest."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def on(self) -> bool:
        return getattr(self._local, "on", False)

    @contextlib.contextmanager
    def block(self, enabled: bool = True) -> Iterator[None]:
        saved = self.on
        self._local.on = enabled
        try:
            yield
        finally:
            self._local.on = saved
