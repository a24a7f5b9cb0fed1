"""The OpenAI chat-completions wire format: request models (validated strictly) and replies.

Strict validation: a JSON string where a number belongs is a 400, not coerced, as OpenAI's
own API answers. Parameters this server does not implement (tools, penalties, logit bias,
log probabilities, response formats) are refused with a 400 when set to anything but their
neutral value, rather than silently ignored; unknown keys are ignored. Every string must be
valid Unicode (``invalid_text``): JSON can escape a lone surrogate (``"\\ud800"``), which no
tokenizer or UTF-8 encoder takes.

Two extensions beyond OpenAI's fields, for clients that decode as clew's rollouts do:
``allowed_tokens`` (texts of single tokens: only these are sampled, as
``generator.sampling_params.allowed_tokens``) and ``continue_final_message`` (vLLM's name: a
last assistant message is continued, not closed, e.g. a reply prefix like ``<action>``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from clew.serve.openai_errors import BadRequest


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part] | None = None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = None


class ChatCompletionRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Refused unless neutral (see the module docstring).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    # Extensions.
    allowed_tokens: list[str] | None = None
    continue_final_message: bool | None = None

    def unsupported(self) -> str | None:
        """The first parameter set to something this server does not do, else None."""
        checks = {
            "presence_penalty": self.presence_penalty not in (None, 0.0),
            "frequency_penalty": self.frequency_penalty not in (None, 0.0),
            "logit_bias": bool(self.logit_bias),
            "logprobs": bool(self.logprobs),
            "top_logprobs": bool(self.top_logprobs),
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none"),
            "response_format": self.response_format not in (None, {"type": "text"}),
        }
        return next((k for k, bad in checks.items() if bad), None)

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def invalid_text(value: Any, where: str = "") -> BadRequest | None:
    """A 400 naming the first string in ``value`` (a request model, or JSON values) that is
    not valid Unicode (a lone surrogate), else None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            code = ord(value[exc.start])
            return BadRequest(
                f"{where or 'body'}: the text holds a lone surrogate (U+{code:04X}) at "
                f"character {exc.start}, which is not valid Unicode; send UTF-8 text "
                "(in JSON, \\uD800-\\uDFFF escapes only as high-low pairs)",
                param=where or None,
                code="invalid_unicode",
            )
        return None
    if isinstance(value, BaseModel):
        value = {k: getattr(value, k) for k in type(value).model_fields}
    if isinstance(value, dict):
        for key, item in value.items():
            name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
            path = f"{where}.{name}" if where else name
            error = invalid_text(key, path) or invalid_text(item, path)
            if error is not None:
                return error
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            error = invalid_text(item, f"{where}.{i}" if where else str(i))
            if error is not None:
                return error
    return None


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    cid: str, model: str, texts: list[str], reasons: list[str], usage_: dict[str, int]
) -> dict[str, Any]:
    """A whole ``chat.completion`` object."""
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
            for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))
        ],
        "usage": usage_,
    }


def chunk(
    cid: str,
    model: str,
    created: int,
    index: int | None,
    delta: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    usage_: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of a stream (no choices when ``index`` is None)."""
    choices = (
        []
        if index is None
        else [
            {"index": index, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}
        ]
    )
    out: dict[str, Any] = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
    }
    if usage_ is not None:
        out["usage"] = usage_
    return out


def model_card(model_id: str, created: int, parent: str | None = None) -> dict[str, Any]:
    card: dict[str, Any] = {"id": model_id, "object": "model", "created": created}
    card["owned_by"] = "clew"
    if parent is not None:
        card["parent"] = parent
        card["root"] = parent
    return card
