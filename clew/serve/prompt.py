"""Chat messages to the prompt's tokens and pixels, the way clew's rollouts build them.

A conversation is encoded turn by turn with ``ChatFormat`` exactly as an episode is: the
first user turn (after an optional system message), then each assistant reply as its text
and ``<|im_end|>``, then each later user turn opening with the newline that follows a
closed reply, and the assistant header last. An agent that sends its episode as messages
(the frame as an image part, the feedback as text) therefore gets the tokens its policy was
trained on. Within one user message the images come first and its text parts follow,
joined by newlines, which is the layout of ``ChatFormat.user_turn``. Consecutive messages of
one role are merged into one turn.

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
from clew.serve.errors import BadRequest
from clew.serve.protocol import ImagePart, Message

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
    system: list[str] = []
    rest = list(messages)
    while rest and rest[0].role in ("system", "developer"):
        system.append(_text(rest.pop(0), 0))
    turns = _merged(rest, offset=len(system))
    if not turns or turns[0][0] != "user":
        raise BadRequest(
            "the messages must hold a user message, first after any system messages",
            param="messages",
        )
    last_role = turns[-1][0]
    if continue_final and last_role != "assistant":
        raise BadRequest("continue_final_message needs an assistant message last", param="messages")
    if not continue_final and last_role != "user":
        raise BadRequest(
            "the last message must be a user message (or set continue_final_message to "
            "continue a last assistant message)",
            param="messages",
        )
    n_images = sum(isinstance(p, ImagePart) for _, ms in turns for m, _ in ms for p in _parts(m))
    if n_images > limits.max_images:
        raise BadRequest(
            f"the request holds {n_images} images; this server accepts at most "
            f"{limits.max_images} per request",
            param="messages",
            code="too_many_images",
        )
    pieces: list[Chunk] = []
    if system:
        header = "\n".join(system)
        pieces.append(Chunk(chat.encode_text(f"<|im_start|>system\n{header}<|im_end|>\n")))
    for t, (role, group) in enumerate(turns):
        if role == "user":
            texts, images = [], []
            for m, i in group:
                for p in _parts(m):
                    if isinstance(p, ImagePart):
                        images.append(load_image(p.image_url.url, limits, f"messages.{i}"))
                    else:
                        texts.append(p.text)
            pieces.append(_user_turn(chat, "\n".join(texts), images, first=t == 0))
        else:
            text = "\n".join(_text(m, i) for m, i in group)
            final = continue_final and t == len(turns) - 1
            pieces.append(Chunk(chat.encode_text(text) if final else chat.reply_tokens(text)))
    return join_chunks(pieces)


def _user_turn(chat: ChatFormat, text: str, images: list[Image.Image], first: bool) -> Chunk:
    try:
        return chat.user_turn(text, images, first=first)
    except ValueError as exc:  # the processor refusing an image's size or shape
        raise BadRequest(f"an image cannot be encoded for this model: {exc}") from exc


def _merged(messages: list[Message], offset: int) -> list[tuple[str, list[tuple[Message, int]]]]:
    turns: list[tuple[str, list[tuple[Message, int]]]] = []
    for i, m in enumerate(messages, start=offset):
        if m.role in ("system", "developer"):
            raise BadRequest(
                f"messages.{i}: a system message is only accepted before the first user message",
                param=f"messages.{i}",
            )
        if turns and turns[-1][0] == m.role:
            turns[-1][1].append((m, i))
        else:
            turns.append((m.role, [(m, i)]))
    return turns


def _parts(m: Message) -> list:
    if m.content is None:
        return []
    if isinstance(m.content, str):
        return [_TextLike(m.content)]
    return list(m.content)


@dataclass(frozen=True)
class _TextLike:
    text: str


def _text(m: Message, i: int) -> str:
    """The text of a system or assistant message (images are for user messages only)."""
    texts = []
    for p in _parts(m):
        if isinstance(p, ImagePart):
            raise BadRequest(
                f"messages.{i}: images are accepted in user messages only, not in {m.role} "
                "messages",
                param=f"messages.{i}",
            )
        texts.append(p.text)
    return "\n".join(texts)


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
