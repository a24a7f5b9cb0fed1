"""Chat messages to the prompt's tokens and pixels, as the model's chat template lays them out.

A conversation is encoded message by message with ``ChatFormat`` exactly as an episode is,
so an agent that sends its episode as messages (the frame as an image part, the feedback as
text) gets the tokens its policy was trained on, and any other client gets what the Qwen-VL
chat templates render (and vLLM serves) for the same messages:

* each system (or developer) message before the first user message as a system turn, its
  text parts written one after another; a system message later is refused. (Of several
  leading system messages Qwen3-VL's template renders only the first, clew's and
  Qwen2-VL's each: a client that wants one system turn sends one.)
* each user message as a turn of its own, its text and image parts in the order sent (an
  image as ``<|vision_start|><|image_pad|>*N<|vision_end|>``, text parts written with
  nothing between them: ``ChatFormat.user_parts``); a string content is its text;
* each assistant message as its text and ``<|im_end|>`` (the last one left open with
  ``continue_final_message``); images only in user messages;
* consecutive messages of one role stay separate turns, each closed and the next opened
  with its own header, as the templates write them; the assistant header comes last.

Every text a client sends is encoded as plain text (``ChatFormat.encode_plain``): a
special-token string in a message, such as ``"<|im_end|>"``, is its characters' tokens,
never the control token, so a message cannot close its turn or add image tokens.

Images come as data URLs (``data:image/png;base64,...``). Remote ``http(s)`` URLs are
refused unless the server allows them (``--allow-remote-images``: the server then fetches
whatever URL a client names, from inside its network). Every image is checked against the
limits before it is decoded whole: its encoded size, its pixel count (from the header, so a
decompression bomb is refused before it expands) and the number of images per request.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import urllib.request
from dataclasses import dataclass

from PIL import Image

from clew.models.chat import ChatFormat, Chunk, join_chunks
from clew.serve.openai_errors import BadRequest
from clew.serve.protocol import ImagePart, Message, TextPart

_DATA_URL = re.compile(
    r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*),(?P<data>.*)", re.S
)


@dataclass(frozen=True)
class PromptLimits:
    """What one request may carry."""

    max_images: int = 8
    max_image_bytes: int = 8 << 20
    max_image_pixels: int = 16 << 20
    allow_remote_images: bool = False
    remote_timeout_s: float = 10.0


def build_prompt(
    messages: list[Message], chat: ChatFormat, limits: PromptLimits, *, continue_final: bool
) -> Chunk:
    """The tokens (and pixels) that make the model write the next assistant reply."""
    n_system = 0
    while n_system < len(messages) and messages[n_system].role in ("system", "developer"):
        n_system += 1
    rest = messages[n_system:]
    for i, m in enumerate(rest, start=n_system):
        if m.role in ("system", "developer"):
            raise BadRequest(
                f"messages.{i}: a system message is only accepted before the first user message",
                param=f"messages.{i}",
            )
    if not rest or rest[0].role != "user":
        raise BadRequest(
            "the messages must hold a user message, first after any system messages",
            param="messages",
        )
    if continue_final and rest[-1].role != "assistant":
        raise BadRequest("continue_final_message needs an assistant message last", param="messages")
    if not continue_final and rest[-1].role != "user":
        raise BadRequest(
            "the last message must be a user message (or set continue_final_message to "
            "continue a last assistant message)",
            param="messages",
        )
    n_images = sum(isinstance(p, ImagePart) for m in messages for p in _parts(m))
    if n_images > limits.max_images:
        raise BadRequest(
            f"the request holds {n_images} images; this server accepts at most "
            f"{limits.max_images} per request",
            param="messages",
            code="too_many_images",
        )
    # A user turn's chunk ends with the assistant header; a turn that another turn follows
    # instead of a reply ends at its <|im_end|> (``_ended``), and the next turn opens with
    # the newline and its own header, as the chat template writes each message.
    newline = chat.encode_text("\n")
    header = chat.encode_text("<|im_start|>assistant\n")
    pieces: list[Chunk] = [
        Chunk(chat.system_turn(_text(m, i))) for i, m in enumerate(messages[:n_system])
    ]
    previous: str | None = None
    for i, m in enumerate(rest, start=n_system):
        if m.role == "user":
            if previous == "user":
                pieces[-1] = _ended(pieces[-1], newline + header)
            parts = _user_parts(m, i, limits)
            pieces.append(_user_turn(chat, parts, first=previous is None))
        else:
            if previous == "assistant":
                pieces.append(Chunk(newline + header))
            text = _text(m, i)
            final = continue_final and i == len(messages) - 1
            pieces.append(Chunk(chat.encode_plain(text) if final else chat.reply_tokens(text)))
        previous = m.role
    return join_chunks(pieces)


def _user_parts(m: Message, i: int, limits: PromptLimits) -> list[str | Image.Image]:
    """A user message's text and images, in the order it gives them (no content: an empty
    turn, as vLLM reads a missing content)."""
    where = f"messages.{i}"
    return [
        load_image(p.image_url.url, limits, where) if isinstance(p, ImagePart) else p.text
        for p in _parts(m)
    ]


def _user_turn(chat: ChatFormat, parts: list[str | Image.Image], first: bool) -> Chunk:
    # system="": the request's own system messages are the prompt's whole system turn.
    try:
        return chat.user_parts(parts, first=first, system="")
    except ValueError as exc:  # the processor refusing an image's size or shape
        raise BadRequest(f"an image cannot be encoded for this model: {exc}") from exc


def _ended(chunk: Chunk, tail: list[int]) -> Chunk:
    """A user turn's ``chunk`` without the ``tail`` (newline and assistant header) after its
    ``<|im_end|>``."""
    ids = chunk.token_ids
    if ids[len(ids) - len(tail) :] != tail:
        raise AssertionError("a user turn does not end with the assistant header")
    return Chunk(ids[: len(ids) - len(tail)], chunk.pixel_values, chunk.image_grid_thw)


def _parts(m: Message) -> list[TextPart | ImagePart]:
    if m.content is None:
        return []
    if isinstance(m.content, str):
        return [TextPart(type="text", text=m.content)]
    return list(m.content)


def _text(m: Message, i: int) -> str:
    """The text of a system or assistant message: its text parts written one after another,
    as the chat template writes them (images are for user messages only)."""
    texts = []
    for p in _parts(m):
        if isinstance(p, ImagePart):
            raise BadRequest(
                f"messages.{i}: images are accepted in user messages only, not in {m.role} "
                "messages",
                param=f"messages.{i}",
            )
        texts.append(p.text)
    return "".join(texts)


def load_image(url: str, limits: PromptLimits, where: str = "messages") -> Image.Image:
    """The RGB image of a data URL (or, if allowed, an http(s) URL); ``BadRequest`` if it is
    refused, too large or cannot be decoded."""
    if url.startswith("data:"):
        raw = _data_url_bytes(url, limits, where)
    elif url.startswith(("http://", "https://")):
        if not limits.allow_remote_images:
            raise BadRequest(
                f"{where}: remote image URLs are refused by this server; send the image as a "
                "data URL (data:image/png;base64,...), or start the server with "
                "--allow-remote-images",
                param=where,
                code="remote_image_refused",
            )
        raw = _fetch(url, limits, where)
    else:
        raise BadRequest(
            f"{where}: an image_url must be a data URL (data:image/png;base64,...)"
            + (" or an http(s) URL" if limits.allow_remote_images else ""),
            param=where,
            code="invalid_image_url",
        )
    return _decode(raw, limits, where)


def _data_url_bytes(url: str, limits: PromptLimits, where: str) -> bytes:
    m = _DATA_URL.fullmatch(url)
    if m is None or ";base64" not in (m.group("params") or ""):
        raise BadRequest(
            f"{where}: an image data URL must look like data:image/png;base64,<data>",
            param=where,
            code="invalid_image_url",
        )
    data = m.group("data")
    if len(data) * 3 // 4 > limits.max_image_bytes + 2:
        raise _too_large(len(data) * 3 // 4, limits, where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(
            f"{where}: the image data is not valid base64 ({exc})",
            param=where,
            code="invalid_image",
        ) from exc


def _fetch(url: str, limits: PromptLimits, where: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=limits.remote_timeout_s) as resp:
            raw = resp.read(limits.max_image_bytes + 1)
    except (OSError, ValueError) as exc:
        raise BadRequest(
            f"{where}: cannot fetch the image at {url}: {exc}", param=where, code="invalid_image"
        ) from exc
    if len(raw) > limits.max_image_bytes:
        raise _too_large(len(raw), limits, where)
    return raw


def _too_large(size: int, limits: PromptLimits, where: str) -> BadRequest:
    return BadRequest(
        f"{where}: an image of {size:,} bytes is over this server's limit of "
        f"{limits.max_image_bytes:,} bytes",
        param=where,
        code="image_too_large",
    )


def _decode(raw: bytes, limits: PromptLimits, where: str) -> Image.Image:
    if len(raw) > limits.max_image_bytes:
        raise _too_large(len(raw), limits, where)
    try:
        with Image.open(io.BytesIO(raw)) as image:
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise BadRequest(
                    f"{where}: an image of {width} x {height} pixels is over this server's "
                    f"limit of {limits.max_image_pixels:,} pixels",
                    param=where,
                    code="image_too_large",
                )
            return image.convert("RGB")
    except BadRequest:
        raise
    except Exception as exc:  # PIL raises many kinds for undecodable data; all are the client's
        raise BadRequest(
            f"{where}: the image cannot be decoded ({type(exc).__name__}: {exc})",
            param=where,
            code="invalid_image",
        ) from exc
