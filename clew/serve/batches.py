"""The scheduler's engine batches: their rows, the key that decides which requests share one,
and how a failed step is narrowed down to the rows that fail it.

Narrowing (``isolate``): when an engine step of a batch raises, the batch's cache is left
half-written and is dropped whole. Its rows are restarted in two new batches, halves of the
old one, each re-prefilling its rows' prompts with the tokens they have generated so far
(``Row.chunk``) and stepping once; a half that fails again is halved again, down to single
rows, and a single row that fails is that request's failure alone. A greedy row that
restarts samples the token it would have sampled next: its cache holds the same tokens as
before, now prefilled in one forward. A sampled row draws from a new generator from there.
Rows that do not fail go on in the new batches; a step that fails for k of n rows costs
about ``2 k log2(n)`` extra prefills.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from clew.inference.cache_batch import CacheBatch
from clew.inference.sampling import SamplingParams
from clew.models.chat import Chunk
from clew.serve.reply import Reply
from clew.serve.tickets import GenerationRequest, Ticket

T = TypeVar("T")


@dataclass
class Row:
    """One sequence of a request (``index`` of its ``n``) in an engine batch."""

    ticket: Ticket
    index: int
    reply: Reply
    longest: int  # the most cache columns it may take: prompt, max_tokens and one step
    started: bool = False  # its prompt (and reply so far) is in the batch's cache

    @property
    def request(self) -> GenerationRequest:
        return self.ticket.request

    def chunk(self) -> Chunk:
        """What its first step in a batch feeds: the prompt, and the tokens it has generated
        so far when it restarts in a new batch."""
        prompt, tokens = self.request.prompt, self.reply.tokens
        if not tokens:
            return prompt
        return Chunk(prompt.token_ids + tokens, prompt.pixel_values, prompt.image_grid_thw)


@dataclass
class Batch:
    """An engine batch of rows that share sampling settings (``key``)."""

    key: tuple[Any, ...]
    adapters: set[str]  # the adapters its rows use, each pinned once
    cache: CacheBatch
    params: SamplingParams
    rows: dict[int, Row]  # by the engine's sequence id
    seed: int

    def request_ids(self) -> list[str]:
        return sorted({row.request.request_id for row in self.rows.values()})


def rows_of(tickets: list[Ticket], tokens_per_step: int) -> list[Row]:
    """The rows of ``tickets``, ``n`` each, in order."""
    return [
        Row(t, i, Reply(t.request.max_tokens, t.request.stop), longest(t.request, tokens_per_step))
        for t in tickets
        for i in range(t.request.n)
    ]


def longest(request: GenerationRequest, tokens_per_step: int) -> int:
    """The most cache columns a row of ``request`` may take."""
    return len(request.prompt.token_ids) + request.max_tokens + tokens_per_step


def batch_key(ticket: Ticket, solo: itertools.count) -> tuple[Any, ...]:
    """Which running batch ``ticket`` may join (the scheduler's module docstring): greedy
    requests share one, unseeded sampled ones one per temperature and top_p, and a seeded
    one gets its own (numbered from ``solo``)."""
    r = ticket.request
    if r.temperature == 0:
        sampling: tuple[Any, ...] = ("greedy",)
    elif r.seed is not None:
        if ticket.solo is None:
            ticket.solo = next(solo)
        sampling = ("seeded", ticket.solo)
    else:
        sampling = ("sampled", r.temperature, r.top_p)
    return (sampling, r.allowed_tokens)


def isolate(
    rows: list[T],
    attempt: Callable[[list[T]], None],
    fail: Callable[[T, Exception], None],
    error: Exception,
) -> None:
    """Rows whose step raised ``error`` together, narrowed down (module docstring):
    ``attempt`` restarts a group of them (raising if its step fails again), ``fail`` ends
    a single row that fails."""
    if len(rows) == 1:
        fail(rows[0], error)
        return
    mid = len(rows) // 2
    for half in (rows[:mid], rows[mid:]):
        if not half:
            continue
        try:
            attempt(half)
        except Exception as again:
            isolate(half, attempt, fail, again)
