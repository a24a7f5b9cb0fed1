"""The HTTP app: OpenAI's chat completions and model list, health, readiness and metrics.

``create_app(server)`` wraps a ``Server`` (``clew.serve.server``: the engine, the adapter
store and the scheduler) in FastAPI. Routes:

* ``POST /v1/chat/completions``: OpenAI's format, whole or streamed (server-sent events);
* ``GET /v1/models`` and ``GET /v1/models/{id}``: the base as ``ID``, every adapter under
  the prefix as ``ID:NAME``;
* ``GET /health`` (the process and its scheduler live), ``GET /ready`` (serving, not
  shutting down), ``GET /metrics`` (Prometheus text);
* ``GET /playground`` and its API under ``/playground/api/`` (``clew.serve.playground``).

With an API key set, ``/v1/*`` and ``/playground/api/*`` need ``Authorization: Bearer KEY``
(a 401 otherwise, checked before the body is read); health, readiness, metrics and the
playground page (which asks for the key) stay open (``clew.serve.middleware``). Every error,
a body that is not JSON included, is answered with an OpenAI error body and a 4xx status for
the client's mistakes; a 500 means the server failed, for that request only, and its log
line names the request's ``X-Request-Id``. Every status a route sends is in its OpenAPI
schema (``/openapi.json``); docs/serving.md lists the limits and what each refusal means.

A client that disconnects frees its rows before the next decode step: a stream's next
write fails, and a whole reply's handler watches the connection while it waits.

Shutting down (SIGTERM to ``clew serve``, ``run_server``): readiness turns 503 at once,
uvicorn stops accepting connections, and the requests in flight, streams included, finish
until ``--shutdown-timeout``; those still running then are answered with a 503
(``shutting_down``) in OpenAI's format, and the scheduler stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from clew.serve.middleware import (
    REQUEST_ID_HEADER,
    ApiKey,
    BodyLimit,
    RequestId,
    SafeJSON,
    error_response,
    request_id_of,
)
from clew.serve.openai_errors import BadRequest, ServeError, error_body
from clew.serve.openapi import document_errors, errors
from clew.serve.playground import playground_router
from clew.serve.protocol import (
    ChatCompletionRequest,
    chunk,
    completion,
    completion_id,
    invalid_text,
    usage,
)
from clew.serve.scheduler import Admitted, Delta, Failed, Finished, Ticket

if TYPE_CHECKING:
    from clew.serve.server import Server

log = logging.getLogger(__name__)


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.start()
        try:
            yield
        finally:
            server.draining = True
            await asyncio.to_thread(server.close)

    app = FastAPI(
        title="clew serve",
        summary="OpenAI-compatible chat completions for a Qwen-VL policy and its LoRA adapters",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        default_response_class=SafeJSON,
    )
    app.state.server = server
    app.add_middleware(BodyLimit, limit=server.settings.max_request_bytes)
    app.add_middleware(ApiKey, key=server.settings.api_key)
    app.add_middleware(RequestId)
    _install_error_handlers(app)
    app.include_router(playground_router(server))

    @app.post(
        "/v1/chat/completions",
        responses=errors(400, 401, 404, 413, 500, 503),
        response_class=SafeJSON,
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        start = time.perf_counter()
        adapter: str | None = None
        watch: asyncio.Task | None = None
        try:
            try:
                if (bad := invalid_text(body)) is not None:
                    raise bad
                adapter = await server.resolve(body.model)
                rid = request.state.request_id
                prepared = await server.prepare(body, adapter, request_id=rid)
                ticket = server.scheduler.submit(prepared, asyncio.get_running_loop())
                watch = asyncio.create_task(_watch(request, ticket))
                first = await ticket.next()
                if isinstance(first, Failed):
                    raise first.error
            except ServeError as error:
                server.metrics.requests.labels(server.label(adapter), str(error.status)).inc()
                return error_response(error)
            label = server.label(adapter)
            server.metrics.requests.labels(label, "200").inc()
            prompt_tokens = len(prepared.prompt.token_ids)
            server.metrics.prompt_tokens.labels(label).inc(prompt_tokens)
            reply = _Reply(server, ticket, body.model, label, start, prompt_tokens)
            if body.stream:
                watch.cancel()  # a stream notices a client gone when it writes or listens
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(
                    reply.stream(include_usage),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            return await reply.whole()
        finally:
            if watch is not None:
                watch.cancel()

    @app.get("/v1/models", responses=errors(401, 500))
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": await asyncio.to_thread(server.model_cards)}

    @app.get("/v1/models/{model_id:path}", responses=errors(401, 404, 500))
    async def retrieve_model(model_id: str) -> Response:
        cards = await asyncio.to_thread(server.model_cards)
        card = next((c for c in cards if c["id"] == model_id), None)
        if card is None:
            return error_response(await asyncio.to_thread(server.not_found, model_id))
        return SafeJSON(card)

    @app.get("/health", responses=errors(500, 503))
    async def health() -> Response:
        alive = server.scheduler.alive or not server.started
        return SafeJSON({"status": "ok" if alive else "dead"}, status_code=200 if alive else 503)

    @app.get("/ready", responses=errors(500, 503))
    async def ready() -> Response:
        ok = server.started and server.scheduler.alive and not server.draining
        return SafeJSON(
            {"status": "ready" if ok else ("draining" if server.draining else "starting")},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics", responses=errors(500))
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    document_errors(app)
    return app


async def _watch(request: Request, ticket: Ticket) -> None:
    """Abandon ``ticket`` when its client disconnects (the body is read: what the
    connection says next is that it closed)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            ticket.abandon()
            return


class _Reply:
    """Collects or streams one request's events into OpenAI's reply objects."""

    def __init__(
        self, server: Server, ticket: Ticket, model: str, label: str, start: float, prompt: int
    ) -> None:
        self.server, self.ticket, self.model, self.label = server, ticket, model, label
        self.start, self.prompt_tokens = start, prompt
        self.n = ticket.request.n
        self.cid = completion_id()
        self._first_token = False

    def _saw_token(self) -> None:
        if not self._first_token:
            self._first_token = True
            elapsed = time.perf_counter() - self.start
            self.server.metrics.first_token.labels(self.label).observe(elapsed)

    def _done(self) -> None:
        elapsed = time.perf_counter() - self.start
        self.server.metrics.latency.labels(self.label).observe(elapsed)

    async def whole(self) -> Response:
        texts, reasons = [""] * self.n, ["length"] * self.n
        tokens = finished = 0
        while finished < self.n:
            event = await self.ticket.next()
            if isinstance(event, Delta):
                self._saw_token()
                texts[event.index] += event.text
            elif isinstance(event, Finished):
                reasons[event.index] = event.reason
                tokens += event.completion_tokens
                finished += 1
            elif isinstance(event, Failed):
                self.ticket.cancel()
                return error_response(event.error)
        self._done()
        body = completion(self.cid, self.model, texts, reasons, usage(self.prompt_tokens, tokens))
        return SafeJSON(body)

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        tokens = finished = 0
        try:
            for i in range(self.n):
                yield _sse(
                    chunk(self.cid, self.model, created, i, {"role": "assistant", "content": ""})
                )
            while finished < self.n:
                event = await self.ticket.next()
                if isinstance(event, Delta):
                    self._saw_token()
                    delta = {"content": event.text}
                    yield _sse(chunk(self.cid, self.model, created, event.index, delta))
                elif isinstance(event, Finished):
                    tokens += event.completion_tokens
                    finished += 1
                    yield _sse(chunk(self.cid, self.model, created, event.index, {}, event.reason))
                elif isinstance(event, Failed):
                    # Headers are sent: the error goes in the stream, as OpenAI's API does.
                    yield _sse(event.error.body())
                    return
                elif isinstance(event, Admitted):
                    continue
            self._done()
            if include_usage:
                total = usage(self.prompt_tokens, tokens)
                yield _sse(chunk(self.cid, self.model, created, None, usage_=total))
            yield "data: [DONE]\n\n"
        finally:
            if finished < self.n:
                self.ticket.cancel()  # the client went away, or the batch failed


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServeError)
    async def serve_error(_: Request, exc: ServeError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return SafeJSON(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> Response:
        # Outside the request-id middleware: the header is set here.
        rid = request_id_of(request.scope)
        log.error("request %s failed: %s: %s", rid, type(exc).__name__, exc, exc_info=exc)
        message = f"the server failed on this request ({type(exc).__name__}; request id {rid})"
        body = error_body(message, "server_error", code="internal_error")
        return SafeJSON(body, status_code=500, headers={REQUEST_ID_HEADER: rid} if rid else None)


def _validation_error(exc: RequestValidationError) -> BadRequest:
    """One line per problem (at most three), each naming the field, as OpenAI's 400s do."""
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        first = next(e for e in errors if e.get("type") == "json_invalid")
        reason = (first.get("ctx") or {}).get("error", "malformed JSON")
        return BadRequest(f"the request body is not valid JSON ({reason})", code="invalid_json")
    if any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return BadRequest(
            "the request body must be a JSON object (Content-Type: application/json)",
            code="invalid_json",
        )
    lines, param = [], None
    for e in errors[:3]:
        # Drop pydantic's names of union branches ("str", "list[...]") from the location.
        loc = [str(x) for x in e.get("loc", ()) if x != "body" and str(x) not in _BRANCHES]
        where = ".".join(x for x in loc if "[" not in x)
        param = param or where or None
        lines.append(f"{where or 'body'}: {e.get('msg')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return BadRequest("; ".join(lines) + more, param=param)


_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "none"}
