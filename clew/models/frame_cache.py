"""Resized frames kept by their content, so a frame shown again is resized once.

An agent's observations repeat: the samples of one GRPO prompt all start from the same
frame, a maze shows the same frame again whenever a move is refused or a cell is revisited,
and an evaluation replays the same fixed mazes. Where the image processor resizes frames
(Qwen3-VL's patch 16 x merge 2 takes ``maze_2d/easy``'s 252 px frames to 256 px), the
resize was most of the host work of a turn, several times the cost of fingerprinting the
frame. In a 192-episode, 5-turn rollout of the untrained tiny
Qwen3-VL policy on ``maze_2d/easy`` (whose moves are mostly refused) 25 of 962 frames were
distinct; a trained policy moves more, but its samples of a prompt still start alike and
follow much the same path.

The key is the SHA-256 of the frame's pixels with its size and mode and the target size
and filter, so two frames share an entry only when their bytes are equal (up to a SHA-256
collision). Entries are read-only uint8 arrays; the least recently used go first once
the entries pass ``capacity_bytes``. One lock guards the table: frames are encoded on
``generator.env_workers`` threads.

Why not ``functools.lru_cache``: it keys on the image object, not its content, and bounds
entries, not bytes.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np
from PIL import Image

__all__ = ["FrameCache", "frame_cache"]

DEFAULT_BYTES = 64 << 20  # about 330 maze frames of 256 px


class FrameCache:
    """Read-only arrays by key, least recently used first out past ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int = DEFAULT_BYTES) -> None:
        self.capacity_bytes = capacity_bytes
        self.hits = self.misses = 0
        self._items: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def resized(
        self,
        image: Image.Image,
        size: tuple[int, int],
        resample: int,
        resize: Callable[[], Image.Image],
    ) -> np.ndarray:
        """``np.asarray(resize())`` for ``image`` at ``size`` (height, width) with filter
        ``resample``, from the table when the same pixels were resized so before."""
        if self.capacity_bytes <= 0:
            self.misses += 1  # unguarded: a count for benchmarks, not for correctness
            return np.asarray(resize(), dtype=np.uint8)
        digest = hashlib.sha256(image.tobytes()).digest()
        key = (digest, image.size, image.mode, size, resample)
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
        array = np.asarray(resize(), dtype=np.uint8)  # a new array over the image's bytes
        array.flags.writeable = False
        with self._lock:
            if key not in self._items:
                self._items[key] = array
                self._bytes += array.nbytes
                while self._bytes > self.capacity_bytes and self._items:
                    _, old = self._items.popitem(last=False)
                    self._bytes -= old.nbytes
        return array


frame_cache = FrameCache()
"""The process's table, used by ``clew.models.pixels``; ``capacity_bytes = 0`` turns it off."""
