"""The server's OpenAPI schema (``GET /openapi.json``) lists every status its routes send.

Each route names its error statuses (``errors``), each documented with OpenAI's error body.
FastAPI documents a 422 for every route that validates input, but this server answers
invalid input with a 400 in OpenAI's format (``clew.serve.app``), so ``document_errors``
takes the 422 out of the schema. A client generated from the schema, or a fuzzer checking
the answers against it (``tests/serve/test_serve_fuzz.py``), then sees the statuses the server
really sends.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


WHAT = {
    400: "Invalid request: malformed or mistyped body, unsupported or out-of-range "
    "parameter, invalid Unicode, too many or unreadable images, over the context",
    401: "Missing or wrong API key (only when the server has one)",
    404: "No such model or adapter (the message lists the served ones)",
    409: "The playground episode's state is over or does not replay",
    413: "The request body is over --max-request-bytes",
    500: "The server failed on this request (an adapter that cannot be loaded, or a "
    "failure inside the server); other requests are not affected",
    503: "Not ready, overloaded (--max-queue) or shutting down; retry",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route that answers ``codes`` with OpenAI's error body."""
    return {code: {"model": ErrorBody, "description": WHAT[code]} for code in codes}


def document_errors(app: FastAPI) -> None:
    """Make ``app.openapi()`` leave out FastAPI's 422s (module docstring)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                routes=app.routes,
            )
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
