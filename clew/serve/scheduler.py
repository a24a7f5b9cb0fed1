"""The one seam between HTTP and the engine: requests in, batched engine steps, tokens out.

The app submits a ``GenerationRequest`` and reads its ``Ticket``'s events (``Admitted``,
then ``Delta``s and one ``Finished`` per choice, or ``Failed``); it never touches the
engine, the model or the adapters. One thread owns those. Each turn of its loop it

1. admits waiting requests: those with the same batch key (the sampling settings one
   engine batch shares) join one new ``CacheBatch`` whatever model they ask for, each row
   naming its request's adapter (None: the base) to the engine, which applies every row's
   own low-rank update in the same forward. An adapter is loaded into the engine first if
   it is not held (``clew.serve.adapter_pool``, fetched off-thread by the store); a
   request whose adapter is still on its way waits for the next batch;
2. advances every open batch by ``tokens_per_step`` tokens (``extend_and_generate``: the
   first call prefills the prompts, later ones feed each row its pending token with an
   empty chunk);
3. turns each row's new tokens into text for its ticket, and ends rows on the stop token, a
   stop string or their ``max_tokens``; ended rows leave the batch (``CacheBatch.drop``).

One token a step (the default) streams token by token and ends every row exactly where it
should. More tokens a step leave the engine's own decode loop running longer between
admissions, for less host work per token; a row that ends inside a step has sampled up to
``tokens_per_step - 1`` tokens it does not keep (its reply and usage count exclude them).

So batches of different sampling settings interleave step by step, and a request that
arrives while a batch of its key runs waits for that batch to end, then opens the next one
together with everything else that waited. Rows of one request never wait on another's.
Only this module's insides change when the engine lets a row join a running batch
(continuous batching).

Batch keys: a greedy request shares a batch with every greedy request, base or adapter (its
tokens do not depend on the batch); an unseeded sampled one with those of the same
temperature and top_p; a seeded one gets a batch of its own seeded by it, so the same
request with the same seed samples the same tokens whatever else is running.

The adapters a batch's rows use are pinned in ``LoadedAdapters`` until their last row
leaves: evicting one under running rows would fail their batch at its next forward.

Stop strings and what a row's reply keeps are ``clew.serve.reply``'s.
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

log = logging.getLogger(__name__)

_CONTINUE = Chunk([])  # a step that only feeds each row its pending token


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: ``n`` replies to ``prompt`` from the base (None) or an adapter."""

    adapter: str | None
    prompt: Chunk
    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    allowed_tokens: tuple[str, ...] = ()


@dataclass(frozen=True)
class Admitted:
    """The request joined a batch (its adapter is loaded); tokens follow."""


@dataclass(frozen=True)
class Delta:
    index: int
    text: str


@dataclass(frozen=True)
class Finished:
    index: int
    reason: str  # "stop" | "length"
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    error: ServeError


Event = Admitted | Delta | Finished | Failed


class Ticket:
    """A submitted request: its events in order (``next``), and ``cancel`` to drop it."""

    def __init__(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, scheduler: Scheduler
    ) -> None:
        self.request = request
        self.cancelled = False
        self.solo: int | None = None  # the batch key of a seeded request, its own
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._scheduler = scheduler

    async def next(self) -> Event:
        return await self._events.get()

    def cancel(self) -> None:
        """Stop generating for this request (the client went away); safe to call twice."""
        self.cancelled = True
        self._scheduler.wake()

    def post(self, event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True


@dataclass
class _Row:
    ticket: Ticket
    index: int
    reply: Reply


@dataclass
class _Batch:
    key: tuple[Any, ...]
    adapters: set[str]  # the adapters its rows use, each pinned once
    cache: CacheBatch
    params: SamplingParams
    rows: dict[int, _Row]
    started: bool = False


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
        longest = len(request.prompt.token_ids) + request.max_tokens + self.tokens_per_step
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
        running = {b.key for b in self._batches}
        groups: dict[tuple[Any, ...], list[Ticket]] = {}
        for t in waiting:
            key = self._key(t)
            if key not in running:
                groups.setdefault(key, []).append(t)
        for key, tickets in groups.items():
            names = [t.request.adapter for t in tickets if t.request.adapter is not None]
            ready, failed = self.adapters.acquire(names, self.wake)  # each ready one pinned
            for name, error in failed.items():
                self.metrics.adapter_load_failures.inc()
                self._reject([t for t in tickets if t.request.adapter == name], error)
            runnable = [t for t in tickets if t.request.adapter in ready | {None}]
            chosen = self._fitting(runnable)
            used = {t.request.adapter for t in chosen} - {None}
            for name in ready - used:
                self.adapters.unpin(name)
            if not chosen:
                continue
            try:
                self._open(key, used, chosen)
            except Exception:
                for name in used:
                    self.adapters.unpin(name)
                raise

    def _fitting(self, tickets: list[Ticket]) -> list[Ticket]:
        """The longest run of ``tickets`` (in arrival order) that one batch can hold now."""
        room = self.max_batch_rows - sum(len(b.rows) for b in self._batches)
        chosen: list[Ticket] = []
        rows = longest = 0
        for t in tickets:
            r = t.request
            length = max(longest, len(r.prompt.token_ids) + r.max_tokens + self.tokens_per_step)
            if rows + r.n > room or self.engine.max_sequences(length) < rows + r.n:
                break
            chosen.append(t)
            rows, longest = rows + r.n, length
        return chosen

    def _open(self, key: tuple[Any, ...], adapters: set[str], tickets: list[Ticket]) -> None:
        """A new batch of ``tickets``' rows; ``adapters`` (theirs) are pinned already."""
        first = tickets[0].request
        seed = first.seed % (1 << 63) if first.seed is not None else random.getrandbits(63)
        rows = [
            _Row(t, i, Reply(t.request.max_tokens, t.request.stop))
            for t in tickets
            for i in range(t.request.n)
        ]
        longest = max(len(t.request.prompt.token_ids) + t.request.max_tokens for t in tickets)
        longest += self.tokens_per_step
        cache = self.engine.open_batch(
            len(rows),
            seed=seed,
            capacity_hint=longest,
            adapters=[row.ticket.request.adapter for row in rows],
        )
        params = SamplingParams(
            temperature=first.temperature,
            top_p=first.top_p,
            max_tokens=self.tokens_per_step,
            allowed_tokens=first.allowed_tokens,
        )
        self._batches.append(_Batch(key, adapters, cache, params, dict(enumerate(rows))))
        with self._cv:
            for t in tickets:
                self._queue.remove(t)
            self.metrics.queue_depth.set(len(self._queue))
        for t in tickets:
            t.post(Admitted())
        self.metrics.batches.inc()
        self.metrics.batch_rows.observe(len(rows))
        self._count_running()

    def _step(self, batch: _Batch) -> None:
        gone = [s for s, row in batch.rows.items() if row.ticket.cancelled]
        if gone:
            self._drop(batch, gone)
        if not batch.rows:
            return
        try:
            chunks = {
                s: (_CONTINUE if batch.started else row.ticket.request.prompt)
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
        batch.started = True
        ended = [s for s, gen in gens.items() if self._advance(batch.rows[s], gen)]
        if ended:
            self._drop(batch, ended)

    def _advance(self, row: _Row, gen: Any) -> bool:
        """Take a row's new tokens; post its text and, if it ended, why. True when ended."""
        delta, reason = row.reply.take(gen.token_ids, gen.finish_reason, self.engine.chat.decode)
        if delta:
            row.ticket.post(Delta(row.index, delta))
        if reason is None:
            return False
        used = len(row.reply.tokens)
        row.ticket.post(Finished(row.index, reason, used))
        self.metrics.completion_tokens.labels(_label(row.ticket.request.adapter)).inc(used)
        return True

    def _drop(self, batch: _Batch, seqs: list[int]) -> None:
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
