"""What every request of the HTTP app passes through before its route: its request id, the
API key and the body size limit, and the JSON every answer is written as.

* ``RequestId``: every response carries ``X-Request-Id``: the client's own, when it sent a
  sane one (``REQUEST_ID_RE``: up to 128 letters, digits and ``._:/+=-``), else a new one.
  Routes read it as ``request.state.request_id``; the server's logs name requests by it.
* ``ApiKey``: a 401 for ``/v1/*`` and ``/playground/api/*`` without ``Authorization: Bearer
  KEY`` (when a key is set), checked before the body is read.
* ``BodyLimit``: a 413 for a body over the limit, before the app reads it whole.
* ``SafeJSON``: a JSON response that cannot fail to encode: text holding a lone surrogate
  (which a client can send as ``"\\ud800"`` and an error message may quote) is written with
  ASCII escapes instead of failing mid-response.
"""

from __future__ import annotations

import hmac
import json
import re
import uuid
from typing import Any

from fastapi.responses import JSONResponse

from clew.serve.openai_errors import ServeError, TooLarge, Unauthorized

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_RE = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")
KEYED = ("/v1/", "/playground/api/")


class SafeJSON(JSONResponse):
    """``JSONResponse`` that writes lone surrogates as ASCII escapes (module docstring)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False).encode("ascii")


def error_response(error: ServeError, request_id: str | None = None) -> SafeJSON:
    """``error`` as OpenAI's error body with its status."""
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return SafeJSON(error.body(), status_code=error.status, headers=headers or None)


def request_id_of(scope: dict) -> str:
    return (scope.get("state") or {}).get("request_id", "")


class RequestId:
    """Gives every request an id and every response its ``X-Request-Id`` header."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.lower().encode(), b"")
        rid = given.decode() if REQUEST_ID_RE.fullmatch(given) else f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        header = (REQUEST_ID_HEADER.lower().encode(), rid.encode())

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != header[0]]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ApiKey:
    """401 for ``KEYED`` paths without ``Authorization: Bearer KEY`` (when a key is set)."""

    def __init__(self, app: Any, key: str | None) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.key and scope["type"] == "http" and scope["path"].startswith(KEYED):
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode("latin-1"), self.key.encode()
            ):
                message = (
                    "missing or wrong API key: send it as 'Authorization: Bearer KEY' "
                    "(OpenAI clients: api_key=KEY)"
                )
                await error_response(Unauthorized(message))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for request bodies over ``limit`` bytes, before the app reads them whole."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = error_response(
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
