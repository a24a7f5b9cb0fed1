"""One OpenAI-compatible endpoint and model, called with the official ``openai`` client.

``Endpoint.reply`` sends one turn's messages with the sampling settings of a rollout
(``RolloutSettings.sampling``: temperature, top_p, max_tokens, stop strings, and
``allowed_tokens`` and ``continue_final_message``, the two request fields ``clew serve``
adds to OpenAI's). Whatever goes wrong on the way is a ``ClewError`` of one line: an
endpoint that cannot be reached, a refused API key, an unknown model (with the names the
server lists). A request the server refuses or fails on its own (any other HTTP error) is a
``RequestRefused`` carrying the server's message, so that an episode can end there with its
reason while the run goes on.

The server's image limit: ``clew serve`` refuses a request holding more than ``--max-images``
images (8 unless started otherwise) with a 400 whose code is ``too_many_images`` and whose
message names the limit ("at most N"), as vLLM's does ("At most N image(s) ...").
``Endpoint.max_images`` is the most images the client sends (None: as many as the episode
has): ``--max-images-per-request`` where given, lowered to the server's own limit when a
refusal names a smaller one (``TooManyImages``), so that every later request of the run
keeps within it. Learning it from the refusal rather than assuming 8 serves a server started
with a larger ``--max-images`` every frame, at the cost of one refused request.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any

from clew.errors import ClewError
from clew.inference.sampling import SamplingParams

_LIMIT = re.compile(r"at most (\d+)", re.IGNORECASE)
_IMAGE_LIMIT = re.compile(r"at most \d+ image", re.IGNORECASE)  # vLLM's wording


class ContextFull(Exception):
    """The server refused a request as longer than the model's context."""


class RequestRefused(ClewError):
    """The server refused this request or failed on it (an HTTP error other than a refused
    key or an unknown model); ``reason`` is its status and its own message, without the URL."""

    def __init__(self, url: str, status: int, message: str) -> None:
        self.status, self.reason = status, f"HTTP {status}: {message}"
        super().__init__(f"{url} answered {self.reason}")


class TooManyImages(RequestRefused):
    """A refusal for holding more images than the server takes; ``limit`` is the most it
    takes, as its message names it (None where the message names no number)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(url, status, message)
        found = _LIMIT.search(message)
        self.limit = int(found.group(1)) if found else None


@dataclass(frozen=True)
class Reply:
    text: str
    stopped: bool  # the reply ended itself (finish_reason "stop"), rather than max_tokens
    prompt_tokens: int
    completion_tokens: int


class Endpoint:
    """``model`` (``ID`` or ``ID:adapter``) at ``url`` (the server's root or its ``/v1``)."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_retries: int = 2,
        max_images: int | None = None,
    ) -> None:
        import openai

        if not url.startswith(("http://", "https://")):
            raise ClewError(f"--endpoint must be an http(s) URL (http://HOST:PORT), got {url!r}")
        if max_images is not None and max_images < 1:
            raise ClewError(
                f"--max-images-per-request must be a positive number of images, got {max_images}"
            )
        self.max_images = max_images
        # Whether a request of this run left frames out to keep within ``max_images`` (more
        # than --keep-last-k-images would have): the policy then saw fewer frames than it
        # would in-process, which the commands say once.
        self.images_left_out = False
        self._lock = threading.Lock()
        base = url.rstrip("/")
        self.url = base if base.endswith("/v1") else base + "/v1"
        self.model = model
        # The client insists on a key; a server without one ignores whatever is sent.
        self.client = openai.OpenAI(
            base_url=self.url,
            api_key=api_key or "none",
            timeout=timeout_s,
            max_retries=max_retries,
        )

    def check(self) -> None:
        """Fail early, with the server's list of names, when the model is not served.

        The list (``GET /v1/models``) rather than one model's card: every OpenAI-compatible
        server lists its models, not all of them answer for one."""
        import openai

        try:
            served = [m.id for m in self.client.models.list()]
        except openai.OpenAIError as err:
            raise self._error(err) from None
        if self.model not in served:
            shown = ", ".join(served[:50]) + (
                f" (and {len(served) - 50} more)" if len(served) > 50 else ""
            )
            raise ClewError(
                f"{self.url}: the model {self.model!r} is not served here; it serves: "
                f"{shown or 'nothing'} (give one as --model)"
            )

    def reply(
        self,
        messages: list[dict[str, Any]],
        sampling: SamplingParams,
        *,
        continue_final: bool,
        seed: int | None = None,
    ) -> Reply:
        import openai

        body = chat_body(messages, sampling, continue_final=continue_final, seed=seed)
        extra = {k: body.pop(k) for k in _CLEW_FIELDS if k in body}
        try:
            r = self.client.chat.completions.create(
                model=self.model, **body, extra_body=extra or None
            )
        except openai.BadRequestError as err:
            if err.code == "context_length_exceeded":
                raise ContextFull(_message(err)) from None
            if err.code == "too_many_images" or _IMAGE_LIMIT.search(_message(err)):
                refused = TooManyImages(self.url, err.status_code, _message(err))
                if refused.limit is not None:
                    self.lower_image_limit(refused.limit)
                raise refused from None
            raise self._error(err) from None
        except openai.OpenAIError as err:
            raise self._error(err) from None
        choice = r.choices[0]
        usage = r.usage
        return Reply(
            text=choice.message.content or "",
            stopped=choice.finish_reason == "stop",
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
        )

    def lower_image_limit(self, limit: int) -> None:
        """Send at most ``limit`` images from now on (never raised: episodes run on threads,
        and a refusal seen by one holds for all)."""
        with self._lock:
            held = self.max_images
            self.max_images = max(1, limit if held is None else min(held, limit))

    def _error(self, err: Exception) -> ClewError:
        import openai

        if isinstance(err, openai.APIConnectionError):
            cause = err.__cause__ or err.__context__
            why = f": {cause}" if cause else ""
            kind = "timed out" if isinstance(err, openai.APITimeoutError) else "is unreachable"
            return ClewError(f"the endpoint {self.url} {kind}{why}")
        if isinstance(err, openai.AuthenticationError):
            return ClewError(
                f"{self.url} refused the API key (HTTP 401): pass the server's key with --api-key"
            )
        if isinstance(err, openai.NotFoundError):
            return ClewError(f"{self.url}: {_message(err)}")
        if isinstance(err, openai.PermissionDeniedError):
            return ClewError(f"{self.url} answered HTTP 403: {_message(err)}")
        if isinstance(err, openai.APIStatusError):
            return RequestRefused(self.url, err.status_code, _message(err))
        return ClewError(f"{self.url}: {type(err).__name__}: {err}")


_CLEW_FIELDS = ("allowed_tokens", "continue_final_message")  # beside OpenAI's own


def chat_body(
    messages: list[dict[str, Any]],
    sampling: SamplingParams,
    *,
    continue_final: bool,
    seed: int | None = None,
) -> dict[str, Any]:
    """A chat-completions request body, but for ``model``: one turn's messages with the
    sampling settings of a rollout, the fields ``clew serve`` adds to OpenAI's included."""
    if sampling.top_k > 0:
        raise ClewError(
            "top_k is not part of the chat-completions API; evaluate through an endpoint "
            "with top_k=-1 (top_p and allowed_tokens are sent)"
        )
    body: dict[str, Any] = {
        "messages": messages,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
    }
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if seed is not None:
        body["seed"] = seed
    if sampling.allowed_tokens:
        body["allowed_tokens"] = list(sampling.allowed_tokens)
    if continue_final:
        body["continue_final_message"] = True
    return body


def _message(err: Any) -> str:
    """The server's own error message (OpenAI's error body), on one line."""
    body = getattr(err, "body", None)
    text = body.get("message") if isinstance(body, dict) else None
    return " ".join(str(text or err).split())
