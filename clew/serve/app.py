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
playground page (which asks for the key) stay open. Every error, a body that is not JSON
included, is answered with an OpenAI error body and a 4xx status for the client's mistakes;
a 500 means the server failed.

Shutting down (SIGTERM to ``clew serve``): readiness turns 503 at once, uvicorn stops
accepting connections and waits for the open ones, streams included, to finish; then the
scheduler finishes what it holds and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from clew.serve.errors import BadRequest, ServeError, TooLarge, Unauthorized, error_body
from clew.serve.playground import playground_router
from clew.serve.protocol import ChatCompletionRequest, chunk, completion, completion_id, usage
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
    )
    app.state.server = server
    app.add_middleware(_BodyLimit, limit=server.settings.max_request_bytes)
    app.add_middleware(_ApiKey, key=server.settings.api_key)
    _install_error_handlers(app)
    app.include_router(playground_router(server))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        start = time.perf_counter()
        label = "unknown"
        try:
            adapter = await server.resolve(body.model)
            label = "base" if adapter is None else adapter
            prepared = await server.prepare(body, adapter)
            ticket = server.scheduler.submit(prepared, asyncio.get_running_loop())
            first = await ticket.next()
            if isinstance(first, Failed):
                raise first.error
        except ServeError as error:
            server.metrics.requests.labels(label, str(error.status)).inc()
            return _error(error)
        server.metrics.requests.labels(label, "200").inc()
        prompt_tokens = len(prepared.prompt.token_ids)
        server.metrics.prompt_tokens.labels(label).inc(prompt_tokens)
        reply = _Reply(server, ticket, body.model, label, start, prompt_tokens)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                reply.stream(include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await reply.whole()

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": await asyncio.to_thread(server.model_cards)}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        cards = await asyncio.to_thread(server.model_cards)
        card = next((c for c in cards if c["id"] == model_id), None)
        if card is None:
            return _error(server.not_found(model_id))
        return JSONResponse(card)

    @app.get("/health")
    async def health() -> Response:
        alive = server.scheduler.alive or not server.started
        return JSONResponse(
            {"status": "ok" if alive else "dead"}, status_code=200 if alive else 503
        )

    @app.get("/ready")
    async def ready() -> Response:
        ok = server.started and server.scheduler.alive and not server.draining
        return JSONResponse(
            {"status": "ready" if ok else ("draining" if server.draining else "starting")},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


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
                return _error(event.error)
        self._done()
        body = completion(self.cid, self.model, texts, reasons, usage(self.prompt_tokens, tokens))
        return JSONResponse(body)

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


def _error(error: ServeError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServeError)
    async def serve_error(_: Request, exc: ServeError) -> Response:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        return _error(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def crash(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error in a request")
        body = error_body(f"the server failed: {type(exc).__name__}", "server_error")
        return JSONResponse(body, status_code=500)


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


_KEYED = ("/v1/", "/playground/api/")


class _ApiKey:
    """401 for ``/v1/*`` and ``/playground/api/*`` requests without ``Authorization: Bearer
    KEY`` (when a key is set)."""

    def __init__(self, app: Any, key: str | None) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.key and scope["type"] == "http" and scope["path"].startswith(_KEYED):
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.key.encode()
            ):
                message = (
                    "missing or wrong API key: send it as 'Authorization: Bearer KEY' "
                    "(OpenAI clients: api_key=KEY)"
                )
                await _error(Unauthorized(message))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """413 for request bodies over ``limit`` bytes, before the app reads them whole."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = _error(
            TooLarge(f"the request body is over this server's limit of {self.limit:,} bytes")
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await too_large(scope, receive, send)
            return
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body"):
                break
        replay = iter(messages)

        async def replayed() -> dict:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)
