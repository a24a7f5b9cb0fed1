"""The one seam between HTTP and the engine: requests in, batched engine steps, tokens out.

The app submits a ``GenerationRequest`` and reads its ``Ticket``'s events
(``clew.serve.tickets``); it never touches the engine, the model or the adapters. One thread
owns those. Each turn of its loop it

1. drops the rows of requests whose client went away;
2. admits waiting requests (continuous batching): those with the same batch key (the
   sampling settings one engine batch shares) join the running ``CacheBatch`` of that key
   between two of its steps (``CacheBatch.add_rows``), or open one if none runs, whatever
   model they ask for: each row names its adapter (None: the base) and the engine applies
   every row's own low-rank update in the same forward. A request joins only while the
   batch stays within ``--max-batch-size`` rows and the KV-cache budget (every row counted
   at its prompt plus ``max_tokens``); otherwise it waits for rows to leave. An adapter not
   held is loaded first (``clew.serve.adapter_pool``, fetched off-thread); a request whose
   adapter is still on its way waits for a later turn;
3. advances every running batch by ``tokens_per_step`` tokens (``extend_and_generate``: a
   row's first step prefills its prompt, in a forward of the rows that just joined; later
   ones feed it its pending token with an empty chunk);
4. turns each row's new tokens into text for its ticket, and ends rows on the stop token, a
   stop string or their ``max_tokens``; ended rows leave (``CacheBatch.drop``) and their
   slots take the next rows that join.

So a request waits for the step in flight, not for a batch to end: a short request that
arrives behind a long one finishes first. Batches of different keys interleave step by
step; rows of one request are admitted together.

One token a step (the default) streams token by token and ends every row exactly where it
should. More tokens a step leave the engine's own decode loop running longer between
admissions, for less host work per token; a row that ends inside a step has sampled up to
``tokens_per_step - 1`` tokens it does not keep (its reply and usage count exclude them).

Batch keys: a greedy request shares a batch with every greedy request, base or adapter (its
tokens do not depend on the batch); an unseeded sampled one with those of the same
temperature and top_p; a seeded one gets a batch of its own seeded by it, so the same
request with the same seed samples the same tokens whatever else is running.

A batch pins each adapter its rows use in ``LoadedAdapters`` (once) until their last row
leaves: evicting one under running rows would fail their batch at its next forward. Stop
strings and what a row's reply keeps are ``clew.serve.reply``'s.

The running batches are ``clew.serve.running``'s, their rows and keys
``clew.serve.batches``'. Isolation: a step that raises fails no request by itself. Its rows
restart in smaller batches until the rows that fail alone are found; only those requests
get a 500, logged with their request ids, and the others go on. A request whose client
went away (``Ticket.cancel``) leaves at the start of the next turn, before the next step.

Shutting down: ``drain`` admits nothing new and, at its deadline, ends whatever still runs
or waits with a 503 (``ShuttingDown``); ``close`` does so at once and waits for the thread
only up to a timeout, so a step that never returns cannot hold the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from clew.errors import ConfigError
from clew.inference.engine import InferenceEngine
from clew.serve.adapter_pool import LoadedAdapters
from clew.serve.batches import Batch, batch_key, longest
from clew.serve.openai_errors import BadRequest, Overloaded, ServeError, ServerFault, ShuttingDown
from clew.serve.prometheus import ServeMetrics
from clew.serve.running import RunningBatches
from clew.serve.tickets import Admitted, Delta, Event, Failed, Finished, GenerationRequest, Ticket  # noqa: F401

log = logging.getLogger(__name__)


class Scheduler:
    """Runs every request through the engine on one thread (module docstring)."""

    def __init__(
        self,
        engine: InferenceEngine,
        adapters: LoadedAdapters,
        metrics: ServeMetrics | None = None,
        *,
        max_batch_rows: int = 64,
        max_queue: int = 1024,
        tokens_per_step: int = 1,
    ) -> None:
        self.engine = engine
        self.adapters = adapters
        self.metrics = metrics or ServeMetrics()
        self.max_batch_rows = max_batch_rows
        self.max_queue = max_queue
        self.tokens_per_step = tokens_per_step
        self.running = RunningBatches(engine, adapters, self.metrics, tokens_per_step)
        self._queue: deque[Ticket] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._draining = False
        self._deadline: float | None = None  # time.monotonic(): end what is left then
        self._held = 0
        self._solo = itertools.count()
        self._thread = threading.Thread(target=self._run, name="clew-serve-scheduler", daemon=True)

    # -- the app's side -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def steps(self) -> int:
        """Engine steps run so far."""
        return self.running.steps

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Ticket:
        """Queue ``request``; its ticket's events come on ``loop``. Raises ``BadRequest`` if
        it can never fit the KV cache, ``Overloaded`` if the queue is full, ``ShuttingDown``
        once the server stops taking requests."""
        tokens = self._longest(request)
        try:
            fits = self.engine.max_sequences(tokens)
        except ConfigError:
            fits = 0
        if fits < 1 or request.n > self.max_batch_rows:
            raise BadRequest(
                f"{request.n} sequence(s) of {tokens} tokens do not fit this server's KV cache "
                f"or batch size (--max-batch-size {self.max_batch_rows}); ask for fewer tokens "
                "or a smaller n",
                code="context_length_exceeded",
            )
        ticket = Ticket(request, loop, self)
        with self._cv:
            if self._stopping or self._draining:
                raise ShuttingDown()
            if len(self._queue) >= self.max_queue:
                raise Overloaded(
                    f"{len(self._queue)} requests are waiting already (--max-queue); retry later"
                )
            self._queue.append(ticket)
            self.metrics.queue_depth.set(len(self._queue))
            self._cv.notify()
        return ticket

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Within the block no request is admitted; what queued meanwhile is admitted
        together after it, as requests that arrive at once would be."""
        with self._cv:
            self._held += 1
        try:
            yield
        finally:
            with self._cv:
                self._held -= 1
                self._cv.notify()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def drain(self, deadline: float) -> None:
        """Admit no new request; end what still runs or waits at ``deadline``
        (``time.monotonic()``) with a 503."""
        with self._cv:
            self._draining = True
            self._deadline = min(deadline, self._deadline or deadline)
            self._cv.notify()

    def close(self, timeout: float | None = 5.0) -> None:
        """End what is queued and running (with a 503) and stop the thread, waiting for it
        up to ``timeout`` seconds (a step in progress finishes first)."""
        with self._cv:
            self._stopping = self._draining = True
            self._deadline = time.monotonic()
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the scheduler's thread -----------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self.running and not self._stopping:
                    self._cv.wait()
                if self._stopping and not self._queue and not self.running:
                    return
            try:
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self._fail_all(ShuttingDown())
                    continue
                self.running.drop_cancelled()
                self._admit()
                self.running.step_all()
            except Exception:  # a bug here must not leave requests hanging forever
                log.exception("the scheduler failed; failing every request it holds")
                self._fail_all(ServerFault("the server failed while scheduling this request"))
            if not self.running:
                with self._cv:
                    if self._queue:
                        # Waiting on an adapter fetch or on room: the fetch's callback or a
                        # new request wakes the loop; the timeout is only a safety net.
                        self._cv.wait(0.05)

    def _admit(self) -> None:
        with self._cv:
            for t in [t for t in self._queue if t.cancelled]:
                self._queue.remove(t)
            waiting = [] if self._held else list(self._queue)
        running = self.running.by_key()
        groups: dict[tuple[Any, ...], list[Ticket]] = {}
        for t in waiting:
            groups.setdefault(batch_key(t, self._solo), []).append(t)
        for key, tickets in groups.items():
            names = [t.request.adapter for t in tickets if t.request.adapter is not None]
            ready, failed = self.adapters.acquire(names, self.wake)  # each ready one pinned
            for name, error in failed.items():
                self.metrics.adapter_load_failures.inc()
                self._reject([t for t in tickets if t.request.adapter == name], error)
            runnable = [t for t in tickets if t.request.adapter in ready | {None}]
            batch = running.get(key)
            chosen = self._fitting(runnable, batch)
            used = {t.request.adapter for t in chosen} - {None}
            for name in ready - used:
                self.adapters.unpin(name)
            if not chosen:
                continue
            try:
                if batch is None:
                    first = chosen[0].request
                    seed = first.seed % (1 << 63) if first.seed is not None else None
                    seed = random.getrandbits(63) if seed is None else seed
                    self.running.open(key, used, chosen, seed)
                else:
                    self.running.join(batch, used, chosen)
            except Exception:
                for name in used:
                    self.adapters.unpin(name)
                raise
            self._admitted(chosen)

    def _fitting(self, tickets: list[Ticket], batch: Batch | None) -> list[Ticket]:
        """The longest run of ``tickets`` (in arrival order) that can join ``batch`` (or open
        a new one) now: within the batch size, and within the KV-cache budget with every row
        of the batch counted at its longest."""
        room = self.max_batch_rows - self.running.rows()
        running = list(batch.rows.values()) if batch else []
        widest = max((row.longest for row in running), default=0)
        chosen: list[Ticket] = []
        rows = 0
        for t in tickets:
            r = t.request
            length = max(widest, self._longest(r))
            if rows + r.n > room or self.engine.max_sequences(length) < len(running) + rows + r.n:
                break
            if batch is not None and not batch.cache.can_add(rows + r.n, length):
                break  # the engine's own check of its cache's budget
            chosen.append(t)
            rows, widest = rows + r.n, length
        return chosen

    def _admitted(self, tickets: list[Ticket]) -> None:
        with self._cv:
            for t in tickets:
                self._queue.remove(t)
            self.metrics.queue_depth.set(len(self._queue))
        for t in tickets:
            t.post(Admitted())

    def _longest(self, request: GenerationRequest) -> int:
        return longest(request, self.tokens_per_step)

    def _reject(self, tickets: list[Ticket], error: ServeError) -> None:
        with self._cv:
            for t in tickets:
                if t in self._queue:
                    self._queue.remove(t)
            self.metrics.queue_depth.set(len(self._queue))
        for t in tickets:
            t.post(Failed(error))

    def _fail_all(self, error: ServeError) -> None:
        """End every running and waiting request with ``error``."""
        self.running.fail_all(error)
        with self._cv:
            waiting = list(self._queue)
        self._reject(waiting, error)
