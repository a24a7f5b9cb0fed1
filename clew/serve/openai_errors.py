"""Errors of the server, each with the HTTP status and OpenAI error body it is answered with.

OpenAI's clients read ``{"error": {"message", "type", "param", "code"}}`` and map the status
to an exception class (400 ``BadRequestError``, 401 ``AuthenticationError``, 404
``NotFoundError``, 5xx ``InternalServerError``), so every refusal of this server, from a
malformed body to an adapter that cannot be loaded, is one of these with a message that
says what was wrong and what is accepted.

Why a corrupt adapter is a 500 and not a 4xx: the request named an adapter that exists and
asked for it correctly; that its files cannot be read is the server's storage's fault, not
the client's, and an adapter caught mid-upload may load on a retry (OpenAI's clients retry
5xx answers). It fails that request only: the base and every other adapter keep serving.
"""

from __future__ import annotations

from typing import Any


class ServeError(Exception):
    """An error answered as ``status`` with an OpenAI-style body."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class BadRequest(ServeError):
    """The request is malformed, mistyped, too large or asks for something unsupported."""


class Unauthorized(ServeError):
    status = 401
    code = "invalid_api_key"


class ModelNotFound(ServeError):
    """No base model or adapter of that name (the message lists the available ones)."""

    status = 404
    code = "model_not_found"


class TooLarge(ServeError):
    status = 413
    code = "request_too_large"


class AdapterUnavailable(ServeError):
    """An adapter that exists under the prefix but cannot be read or does not fit the base."""

    status = 500
    type = "server_error"
    code = "adapter_load_failed"


class Overloaded(ServeError):
    status = 503
    type = "server_error"
    code = "overloaded"


class ShuttingDown(ServeError):
    """The server is stopping (SIGTERM): it takes no new request, and ends those still
    running at ``--shutdown-timeout``. Another replica may serve a retry."""

    status = 503
    type = "server_error"
    code = "shutting_down"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "the server is shutting down and did not finish this request; retry it "
            "(another replica, or this server once restarted, serves it)"
        )


class ClientClosed(ServeError):
    """The client closed its connection before the reply was whole (nobody reads it)."""

    status = 499
    code = "client_closed_request"


class ServerFault(ServeError):
    """Something failed inside the server while generating (a bug, or the device failed)."""

    status = 500
    type = "server_error"
    code = "internal_error"


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code=None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def shorten(text: str, limit: int = 80) -> str:
    """``repr(text)`` cut to about ``limit`` characters, saying how long it was: an error
    that names what a client sent must not echo a megabyte back."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"
