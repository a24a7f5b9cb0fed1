"""The adapters held in the engine at once: loaded on first use, pinned while rows run them,
the least recently used evicted when ``--max-adapters`` are held.

Adapters live in the engine beside one plain base (``InferenceEngine.add_adapter``, per-row
LoRA): each row of a batch names its own, so holding several costs only their low-rank
factors. Their files come from the ``AdapterStore``, fetched off the scheduler's thread; the
pool loads one once its fetch has landed and there is room. An adapter that running rows use
is pinned and never evicted: removing it would fail their batch at its next forward.

Each loaded adapter keeps the stamp of the files it was loaded from. When the store has
seen its files change (``AdapterStore.latest``, read for each request), the adapter takes
no new rows: once the rows running on the old copy have left, it is evicted and loaded
again from the new files.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from clew.errors import ClewError
from clew.inference.engine import InferenceEngine
from clew.serve.adapter_store import AdapterFiles, AdapterStore, Stamp
from clew.serve.openai_errors import AdapterUnavailable, ServeError


class LoadedAdapters:
    """At most ``capacity`` adapters in ``engine``; every method runs on the scheduler's
    thread (they change the engine's layers)."""

    def __init__(
        self,
        engine: InferenceEngine,
        store: AdapterStore,
        capacity: int,
        *,
        on_load: Callable[[str, float], None] | None = None,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        if capacity < 1:
            raise ClewError(f"--max-adapters must be at least 1, got {capacity}")
        self.engine = engine
        self.store = store
        self.capacity = capacity
        self.on_load = on_load
        self.on_evict = on_evict
        self._lru: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._stamps: dict[str, Stamp] = {}  # the files each was loaded from
        self._pins: dict[str, int] = {}
        self._fetching: set[str] = set()  # adapters whose fetch will call ``wake``
        self.loads = 0
        self.evictions = 0

    def names(self) -> list[str]:
        return list(self._lru)

    def has(self, name: str) -> bool:
        return name in self._lru

    def stamp(self, name: str) -> Stamp | None:
        """The stamp of the files ``name`` was loaded from, None if it is not loaded (read
        from the event loop too: a dict read)."""
        return self._stamps.get(name)

    def has_room(self) -> bool:
        """Whether one more adapter can be loaded now (evicting an unpinned one if full)."""
        return len(self._lru) < self.capacity or any(not self._pins.get(n) for n in self._lru)

    def pin(self, name: str) -> None:
        self._pins[name] = self._pins.get(name, 0) + 1
        self._lru.move_to_end(name)

    def unpin(self, name: str) -> None:
        left = self._pins.get(name, 0) - 1
        if left > 0:
            self._pins[name] = left
        else:
            self._pins.pop(name, None)

    def acquire(
        self, names: Iterable[str], wake: Callable[[], None]
    ) -> tuple[set[str], dict[str, ServeError]]:
        """Of ``names`` (in the order their requests came), those in the engine now, each
        pinned once (so that loading the next cannot evict it), and the error of each that
        cannot be fetched or loaded. The others wait: for their fetch, which calls ``wake``
        when it lands, or for room, which a batch ending makes."""
        ready: set[str] = set()
        failed: dict[str, ServeError] = {}
        for name in dict.fromkeys(names):
            try:
                if self._ensure(name, wake):
                    self.pin(name)
                    ready.add(name)
            except ServeError as error:
                failed[name] = error
        return ready, failed

    def _ensure(self, name: str, wake: Callable[[], None]) -> bool:
        if name in self._lru:
            latest = self.store.latest(name)
            if latest is None or latest == self._stamps.get(name):
                return True
            if self._pins.get(name):
                return False  # its files changed: reloaded once the rows on this copy leave
            self._evict(name)
        fetch = self.store.prepare(name)
        if not fetch.done():
            if name not in self._fetching:
                self._fetching.add(name)
                fetch.add_done_callback(lambda _: wake())
            return False
        self._fetching.discard(name)
        try:
            files = fetch.result()
            if not self.has_room():
                return False  # every held adapter is in use; one frees when its batch ends
            self.store.discard(name)
            self.load(files)
        except ServeError:
            self.store.discard(name)  # a later request reads the storage afresh
            raise
        return True

    def load(self, files: AdapterFiles) -> None:
        """Put ``files`` into the engine, evicting the least recently used unpinned adapter
        when full; ``AdapterUnavailable`` if it does not fit the base (the engine checks an
        adapter whole before changing anything)."""
        start = time.perf_counter()
        while len(self._lru) >= self.capacity:
            victim = next((n for n in self._lru if not self._pins.get(n)), None)
            if victim is None:
                raise RuntimeError("no adapter can be evicted: every one is in use")
            self._evict(victim)
        try:
            self.engine.add_adapter(files.name, (files.config, files.tensors))
        except Exception as exc:
            message = (
                f"adapter {files.name!r} ({files.source}) does not fit the served base model "
                f"(rank {files.config.get('r')}, target modules "
                f"{files.config.get('target_modules')}): {self.store.public(str(exc))}"
            )
            error = AdapterUnavailable(message)
            self.store.failed(files.name, files.stamp, error)
            raise error from exc
        self._lru[files.name] = None
        self._stamps[files.name] = files.stamp
        self.loads += 1
        if self.on_load:
            self.on_load(files.name, time.perf_counter() - start)

    def _evict(self, name: str) -> None:
        self.engine.remove_adapter(name)
        del self._lru[name]
        self._stamps.pop(name, None)
        self._pins.pop(name, None)
        self.evictions += 1
        if self.on_evict:
            self.on_evict(name)
