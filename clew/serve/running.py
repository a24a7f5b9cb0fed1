"""The engine batches the scheduler runs: opened, joined, stepped and left, on its thread.

``RunningBatches`` owns every running ``Batch`` (``clew.serve.batches``) and the adapter pins
they hold; the ``Scheduler`` decides what to admit and calls it. A step turns each row's new
tokens into text for its ticket and drops the rows that ended. A step that raises is
narrowed to the rows that fail alone (``clew.serve.batches.isolate``): only their requests
get a 500, logged with their request ids.
"""

from __future__ import annotations

import logging
from typing import Any

from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models.chat import Chunk
from clew.serve.adapter_pool import LoadedAdapters
from clew.serve.batches import Batch, Row, isolate, rows_of
from clew.serve.openai_errors import ServeError, ServerFault
from clew.serve.prometheus import ServeMetrics
from clew.serve.tickets import Delta, Event, Failed, Finished, Ticket

log = logging.getLogger("clew.serve.scheduler")

_CONTINUE = Chunk([])  # a step that only feeds each row its pending token


class RunningBatches:
    """The running batches (module docstring); touched by the scheduler's thread only."""

    def __init__(
        self,
        engine: InferenceEngine,
        adapters: LoadedAdapters,
        metrics: ServeMetrics,
        tokens_per_step: int,
    ) -> None:
        self.engine = engine
        self.adapters = adapters
        self.metrics = metrics
        self.tokens_per_step = tokens_per_step
        self.batches: list[Batch] = []
        self.steps = 0  # engine steps run

    def __bool__(self) -> bool:
        return bool(self.batches)

    def rows(self) -> int:
        return sum(len(b.rows) for b in self.batches)

    def by_key(self) -> dict[tuple[Any, ...], Batch]:
        return {b.key: b for b in self.batches}

    # -- rows in --------------------------------------------------------------------
    def open(
        self, key: tuple[Any, ...], adapters: set[str], tickets: list[Ticket], seed: int
    ) -> None:
        """A new batch of ``tickets``' rows; ``adapters`` (theirs) are pinned already."""
        first = tickets[0].request
        params = SamplingParams(
            temperature=first.temperature,
            top_p=first.top_p,
            max_tokens=self.tokens_per_step,
            allowed_tokens=first.allowed_tokens,
        )
        rows = rows_of(tickets, self.tokens_per_step)
        self.batches.append(self._batch(key, adapters, params, rows, seed))
        self.metrics.batches.inc()
        self.metrics.batch_rows.observe(len(rows))
        self.count()

    def join(self, batch: Batch, adapters: set[str], tickets: list[Ticket]) -> None:
        """``tickets``' rows join the running ``batch``; ``adapters`` (theirs) are pinned
        already, and the batch keeps one pin of each."""
        rows = rows_of(tickets, self.tokens_per_step)
        seqs = batch.cache.add_rows(
            len(rows),
            adapters=[row.request.adapter for row in rows],
            tokens=max(row.longest for row in rows),
        )
        batch.rows.update(zip(seqs, rows, strict=True))
        for name in adapters & batch.adapters:
            self.adapters.unpin(name)
        batch.adapters |= adapters
        self.count()

    def _batch(
        self,
        key: tuple[Any, ...],
        adapters: set[str],
        params: SamplingParams,
        rows: list[Row],
        seed: int,
    ) -> Batch:
        cache = self.engine.open_batch(
            len(rows),
            seed=seed,
            capacity_hint=max(row.longest for row in rows),
            adapters=[row.request.adapter for row in rows],
        )
        return Batch(key, adapters, cache, params, dict(enumerate(rows)), seed)

    # -- steps ----------------------------------------------------------------------
    def step_all(self) -> None:
        """One step of every batch (those a failure restarts have taken theirs)."""
        for batch in list(self.batches):
            try:
                gens = self._extend(batch)
            except Exception as error:
                self._isolate(batch, error)
                continue
            self._took(batch, gens)

    def _extend(self, batch: Batch) -> dict[int, Any]:
        """One engine step of ``batch``: a row's first feeds its chunk, later ones nothing."""
        self.steps += 1
        chunks = {s: (_CONTINUE if row.started else row.chunk()) for s, row in batch.rows.items()}
        return batch.cache.extend_and_generate(chunks, batch.params)

    def _took(self, batch: Batch, gens: dict[int, Any]) -> None:
        for row in batch.rows.values():
            row.started = True
        posts: list[tuple[Ticket, Event]] = []
        ended = [s for s, gen in gens.items() if self._advance(batch.rows[s], gen, posts)]
        Ticket.post_all(posts)
        if ended:
            self.drop(batch, ended)

    def _advance(self, row: Row, gen: Any, posts: list[tuple[Ticket, Event]]) -> bool:
        """Take a row's new tokens; post its text and, if it ended, why. True when ended."""
        delta, reason = row.reply.take(gen.token_ids, gen.finish_reason, self.engine.chat.decode)
        if delta:
            posts.append((row.ticket, Delta(row.index, delta)))
        if reason is None:
            return False
        used = len(row.reply.tokens)
        posts.append((row.ticket, Finished(row.index, reason, used)))
        label = "base" if row.request.adapter is None else row.request.adapter
        self.metrics.completion_tokens.labels(label).inc(used)
        return True

    # -- failures -------------------------------------------------------------------
    def _isolate(self, batch: Batch, error: Exception) -> None:
        """``batch``'s step raised ``error``: its rows restart in smaller batches until the
        rows that fail alone are found."""
        log.error(
            "an engine step of %d row(s) failed (requests %s): %s: %s; restarting its rows "
            "in smaller batches to find the rows that fail",
            len(batch.rows),
            ", ".join(batch.request_ids()),
            type(error).__name__,
            error,
        )
        self.batches.remove(batch)
        try:
            rows = list(batch.rows.values())
            isolate(rows, lambda group: self._restart(batch, group), self._fail_row, error)
        finally:
            for name in batch.adapters:
                self.adapters.unpin(name)
            self.count()

    def _restart(self, old: Batch, rows: list[Row]) -> None:
        """``rows`` of the failed batch ``old`` in a new batch, stepped once; raises if that
        step fails too."""
        rows = [row for row in rows if not row.ticket.cancelled]
        if not rows:
            return
        used = {row.request.adapter for row in rows} - {None}
        for name in used:
            self.adapters.pin(name)
        try:
            for row in rows:
                row.started = False
            batch = self._batch(old.key, used, old.params, rows, old.seed)
            gens = self._extend(batch)
        except Exception:
            for name in used:
                self.adapters.unpin(name)
            raise
        self.batches.append(batch)
        self._took(batch, gens)

    def _fail_row(self, row: Row, error: Exception) -> None:
        rid = row.request.request_id
        log.error(
            "request %s failed in an engine step of its own rows: %s: %s",
            rid,
            type(error).__name__,
            error,
            exc_info=error,
        )
        message = f"generation failed inside the server for this request (request id {rid})"
        row.ticket.post(Failed(ServerFault(message)))
        row.ticket.cancelled = True

    # -- rows out -------------------------------------------------------------------
    def drop_cancelled(self) -> None:
        """Drop the rows of requests whose client went away (or that failed)."""
        for batch in list(self.batches):
            self.drop(batch, [s for s, r in batch.rows.items() if r.ticket.cancelled])

    def drop(self, batch: Batch, seqs: list[int]) -> None:
        if not seqs:
            return
        for s in seqs:
            batch.rows.pop(s, None)
        if batch.rows:
            batch.cache.drop(seqs)
        else:
            self.batches.remove(batch)
        used = {row.request.adapter for row in batch.rows.values()}
        for name in batch.adapters - used:
            self.adapters.unpin(name)
        batch.adapters &= used
        self.count()

    def fail_all(self, error: ServeError) -> None:
        """End every running row with ``error``."""
        for batch in list(self.batches):
            for row in batch.rows.values():
                row.ticket.post(Failed(error))
            self.batches.remove(batch)
            for name in batch.adapters:
                self.adapters.unpin(name)
        self.count()

    def count(self) -> None:
        self.metrics.running.set(self.rows())
