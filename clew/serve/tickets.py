"""What the app and the scheduler pass each other: a ``GenerationRequest`` in, a ``Ticket``
back whose events (``Admitted``, then ``Delta``s and one ``Finished`` per choice, or
``Failed``) arrive on the app's event loop, posted from the scheduler's thread."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from clew.models.chat import Chunk
from clew.serve.openai_errors import ClientClosed, ServeError

if TYPE_CHECKING:
    from clew.serve.scheduler import Scheduler


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
    request_id: str = ""  # the X-Request-Id it came with (logs name it)


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

    def abandon(self) -> None:
        """``cancel``, from the event loop, and end whoever waits on ``next`` with
        ``ClientClosed``."""
        self.cancel()
        self._events.put_nowait(Failed(ClientClosed("the client closed the connection")))

    @staticmethod
    def post_all(posts: list[tuple[Ticket, Event]]) -> None:
        """Post many tickets' events in order, one hand-over per event loop: each
        ``call_soon_threadsafe`` wakes the loop's thread, which a decode step of many rows
        would otherwise do once per row."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Ticket, Event]]] = {}
        for ticket, event in posts:
            by_loop.setdefault(ticket._loop, []).append((ticket, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                for ticket, _ in items:
                    ticket.cancelled = True

    def post(self, event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True


def _deliver(items: list[tuple[Ticket, Event]]) -> None:
    for ticket, event in items:
        ticket._events.put_nowait(event)
