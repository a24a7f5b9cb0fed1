"""A switch that is on for a block of code, in the thread that runs it.

The engine turns model-side fast paths on for its own forwards only (``fused_pointwise``,
``clew.models.distinct_images``), while the trainer's forwards of the same model, perhaps in
another thread, keep transformers' code.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class ThreadSwitch:
    """Off unless inside ``block(value)`` in this thread; blocks nest. The value may be any
    object (a function to route calls to, say); the switch is ``on`` while it is truthy."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def value(self) -> Any:
        """The innermost block's value in this thread; None outside every block."""
        return getattr(self._local, "value", None)

    @property
    def on(self) -> bool:
        return bool(self.value)

    @contextlib.contextmanager
    def block(self, value: Any = True) -> Iterator[None]:
        saved = self.value
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = saved
