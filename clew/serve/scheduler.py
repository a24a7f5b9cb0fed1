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
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from clew.errors import ConfigError
from clew.inference.engine import CacheBatch, InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models.chat import Chunk
from clew.serve.adapter_pool import LoadedAdapters
from clew.serve.errors import BadRequest, Overloaded, ServeError, ServerFault
from clew.serve.metrics import ServeMetrics
from clew.serve.reply import Reply
from clew.serve.tickets import Admitted, Delta, Event, Failed, Finished, GenerationRequest, Ticket  # noqa: F401

log = logging.getLogger(__name__)

_CONTINUE = Chunk([])  # a step that only feeds each row its pending token


@dataclass
class _Row:
    ticket: Ticket
    index: int
    reply: Reply
    longest: int  # the most cache columns it may take: prompt, max_tokens and one step
    started: bool = False  # its prompt is in the cache


@dataclass
class _Batch:
    key: tuple[Any, ...]
    adapters: set[str]  # the adapters its rows use, each pinned once
    cache: CacheBatch
    params: SamplingParams
    rows: dict[int, _Row]


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
        self._queue: deque[Ticket] = deque()
        self._batches: list[_Batch] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._held = 0
        self._solo = itertools.count()
        self._thread = threading.Thread(target=self._run, name="clew-serve-scheduler", daemon=True)

    # -- the app's side -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Ticket:
        """Queue ``request``; its ticket's events come on ``loop``. Raises ``BadRequest`` if
        it can never fit the KV cache, ``Overloaded`` if the queue is full or the server is
        stopping."""
        longest = self._longest(request)
        try:
            fits = self.engine.max_sequences(longest)
        except ConfigError:
            fits = 0
        if fits < 1 or request.n > self.max_batch_rows:
            raise BadRequest(
                f"{request.n} sequence(s) of {longest} tokens do not fit this server's KV cache "
                f"or batch size (--max-batch-size {self.max_batch_rows}); ask for fewer tokens "
                "or a smaller n",
                code="context_length_exceeded",
            )
        ticket = Ticket(request, loop, self)
        with self._cv:
            if self._stopping:
                raise Overloaded("the server is shutting down")
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

    def close(self, timeout: float | None = None) -> None:
        """Finish what is queued and running, then stop the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the scheduler's thread -----------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._batches and not self._stopping:
                    self._cv.wait()
                if self._stopping and not self._queue and not self._batches:
                    return
            try:
                for batch in list(self._batches):
                    self._drop(batch, [s for s, r in batch.rows.items() if r.ticket.cancelled])
                self._admit()
                for batch in list(self._batches):
                    self._step(batch)
            except Exception:  # a bug here must not leave requests hanging forever
                log.exception("the scheduler failed; failing every request it holds")
                self._fail_all(ServerFault("the server failed while scheduling this request"))
            if not self._batches:
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
        running = {b.key: b for b in self._batches}
        groups: dict[tuple[Any, ...], list[Ticket]] = {}
        for t in waiting:
            groups.setdefault(self._key(t), []).append(t)
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
                    self._open(key, used, chosen)
                else:
                    self._join(batch, used, chosen)
            except Exception:
                for name in used:
                    self.adapters.unpin(name)
                raise

    def _fitting(self, tickets: list[Ticket], batch: _Batch | None) -> list[Ticket]:
        """The longest run of ``tickets`` (in arrival order) that can join ``batch`` (or open
        a new one) now: within the batch size, and within the KV-cache budget with every row
        of the batch counted at its longest."""
        room = self.max_batch_rows - sum(len(b.rows) for b in self._batches)
        running = list(batch.rows.values()) if batch else []
        longest = max((row.longest for row in running), default=0)
        chosen: list[Ticket] = []
        rows = 0
        for t in tickets:
            r = t.request
            length = max(longest, self._longest(r))
            if rows + r.n > room or self.engine.max_sequences(length) < len(running) + rows + r.n:
                break
            if batch is not None and not batch.cache.can_add(rows + r.n, length):
                break  # the engine's own check (a dynamic KV cache takes no joining rows)
            chosen.append(t)
            rows, longest = rows + r.n, length
        return chosen

    def _rows(self, tickets: list[Ticket]) -> list[_Row]:
        return [
            _Row(t, i, Reply(t.request.max_tokens, t.request.stop), self._longest(t.request))
            for t in tickets
            for i in range(t.request.n)
        ]

    def _open(self, key: tuple[Any, ...], adapters: set[str], tickets: list[Ticket]) -> None:
        """A new batch of ``tickets``' rows; ``adapters`` (theirs) are pinned already."""
        first = tickets[0].request
        seed = first.seed % (1 << 63) if first.seed is not None else random.getrandbits(63)
        rows = self._rows(tickets)
        cache = self.engine.open_batch(
            len(rows),
            seed=seed,
            capacity_hint=max(row.longest for row in rows),
            adapters=[row.ticket.request.adapter for row in rows],
        )
        params = SamplingParams(
            temperature=first.temperature,
            top_p=first.top_p,
            max_tokens=self.tokens_per_step,
            allowed_tokens=first.allowed_tokens,
        )
        self._batches.append(_Batch(key, adapters, cache, params, dict(enumerate(rows))))
        self.metrics.batches.inc()
        self.metrics.batch_rows.observe(len(rows))
        self._admitted(tickets)

    def _join(self, batch: _Batch, adapters: set[str], tickets: list[Ticket]) -> None:
        """``tickets``' rows join the running ``batch``; ``adapters`` (theirs) are pinned
        already, and the batch keeps one pin of each."""
        rows = self._rows(tickets)
        seqs = batch.cache.add_rows(
            len(rows),
            adapters=[row.ticket.request.adapter for row in rows],
            tokens=max(row.longest for row in rows),
        )
        batch.rows.update(zip(seqs, rows, strict=True))
        for name in adapters & batch.adapters:
            self.adapters.unpin(name)
        batch.adapters |= adapters
        self._admitted(tickets)

    def _admitted(self, tickets: list[Ticket]) -> None:
        with self._cv:
            for t in tickets:
                self._queue.remove(t)
            self.metrics.queue_depth.set(len(self._queue))
        for t in tickets:
            t.post(Admitted())
        self._count_running()

    def _step(self, batch: _Batch) -> None:
        try:
            chunks = {
                s: (_CONTINUE if row.started else row.ticket.request.prompt)
                for s, row in batch.rows.items()
            }
            gens = batch.cache.extend_and_generate(chunks, batch.params)
        except Exception:
            log.exception("a decode step failed; failing the requests of its batch")
            error = ServerFault("generation failed inside the server for this request")
            for row in batch.rows.values():
                row.ticket.post(Failed(error))
                row.ticket.cancelled = True
            self._drop(batch, list(batch.rows))
            return
        for row in batch.rows.values():
            row.started = True
        posts: list[tuple[Ticket, Event]] = []
        ended = [s for s, gen in gens.items() if self._advance(batch.rows[s], gen, posts)]
        Ticket.post_all(posts)
        if ended:
            self._drop(batch, ended)

    def _advance(self, row: _Row, gen: Any, posts: list[tuple[Ticket, Event]]) -> bool:
        """Take a row's new tokens; post its text and, if it ended, why. True when ended."""
        delta, reason = row.reply.take(gen.token_ids, gen.finish_reason, self.engine.chat.decode)
        if delta:
            posts.append((row.ticket, Delta(row.index, delta)))
        if reason is None:
            return False
        used = len(row.reply.tokens)
        posts.append((row.ticket, Finished(row.index, reason, used)))
        self.metrics.completion_tokens.labels(_label(row.ticket.request.adapter)).inc(used)
        return True

    def _drop(self, batch: _Batch, seqs: list[int]) -> None:
        if not seqs:
            return
        for s in seqs:
            batch.rows.pop(s, None)
        if batch.rows:
            batch.cache.drop(seqs)
        else:
            self._batches.remove(batch)
        used = {row.ticket.request.adapter for row in batch.rows.values()}
        for name in batch.adapters - used:
            self.adapters.unpin(name)
        batch.adapters &= used
        self._count_running()

    def _longest(self, request: GenerationRequest) -> int:
        return len(request.prompt.token_ids) + request.max_tokens + self.tokens_per_step

    def _key(self, ticket: Ticket) -> tuple[Any, ...]:
        r = ticket.request
        if r.temperature == 0:
            sampling: tuple[Any, ...] = ("greedy",)
        elif r.seed is not None:
            if ticket.solo is None:
                ticket.solo = next(self._solo)
            sampling = ("seeded", ticket.solo)
        else:
            sampling = ("sampled", r.temperature, r.top_p)
        return (sampling, r.allowed_tokens)

    def _reject(self, tickets: list[Ticket], error: ServeError) -> None:
        with self._cv:
            for t in tickets:
                if t in self._queue:
                    self._queue.remove(t)
            self.metrics.queue_depth.set(len(self._queue))
        for t in tickets:
            t.post(Failed(error))

    def _fail_all(self, error: ServeError) -> None:
        for batch in list(self._batches):
            for row in batch.rows.values():
                row.ticket.post(Failed(error))
            self._batches.remove(batch)
            for name in batch.adapters:
                self.adapters.unpin(name)
        with self._cv:
            waiting = list(self._queue)
        self._reject(waiting, error)
        self._count_running()

    def _count_running(self) -> None:
        self.metrics.running.set(sum(len(b.rows) for b in self._batches))


def _label(adapter: str | None) -> str:
    return "base" if adapter is None else adapter
