"""An episode as OpenAI chat messages that encode to the tokens the rollouts feed the policy.

The rollouts build an episode with ``ChatFormat``: each observation is a user turn (its
images first, then its text, or its text first where the observation says ``text_first``),
each reply follows the assistant header, and the reply
prefix (``generator.reply_prefix``) is written after the header before sampling. ``clew
serve`` encodes messages with that same ``ChatFormat`` (``clew.serve.prompt``), so an
episode sent as

* a system message first where the episode's first observation carries a system prompt
  (``Observation.system``), as the rollouts open the episode with it;
* one user message per observation: an ``image_url`` part per frame (a PNG data URL, so the
  server decodes the very pixels the env drew) and one text part, in the observation's
  order (the server keeps the order of a message's parts);
* one assistant message per reply, holding the text the env read (prefix, sampled text,
  suffix), which the server closes with ``<|im_end|>`` as a reply that stopped or was
  closed by the rollouts;
* a last assistant message holding the reply prefix, continued rather than closed
  (``continue_final_message``), when there is a prefix,

is the token sequence of the rollout's episode, as long as the replies' texts re-encode to
the tokens that were sampled (true of the one-token keyword replies that ``allowed_tokens``
restricts a policy to; a free-text reply may tokenize differently once it is text) and a
reply that stopped itself stopped on ``<|im_end|>`` (one that ended on another of the
model's eos ids, such as ``<|endoftext|>``, is sent back closed with ``<|im_end|>``).

``keep_last_k_images``: the engine hides frames older than the last K from attention but
keeps their positions; a chat request can only leave them out, so the older user messages
are sent with their text alone. The policy sees the same K frames, at positions shifted by
the tokens of the frames left out.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from typing import Any

from PIL import Image


def data_url(image: Image.Image) -> str:
    """``image`` as a PNG data URL (lossless: the server decodes the same pixels)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


@dataclass
class Conversation:
    """An episode's turns so far, sent whole with every request (the API is stateless)."""

    # ("user", (text, urls, text_first)) | ("assistant", text)
    turns: list[tuple[str, Any]] = field(default_factory=list)
    system: str | None = None  # the system prompt opening the episode; None or "": none

    def add_observation(
        self, text: str, images: list[Image.Image], *, text_first: bool = False
    ) -> None:
        """An observation as a user turn: its images then its text, or the text first."""
        self.turns.append(("user", (text, [data_url(im) for im in images], text_first)))

    def n_images(self) -> int:
        """The frames of every observation so far."""
        return sum(len(content[1]) for role, content in self.turns if role == "user")

    def add_reply(self, text: str) -> None:
        """The reply as the env read it (reply prefix and suffix included)."""
        self.turns.append(("assistant", text))

    def messages(
        self, *, reply_prefix: str = "", keep_last_k_images: int | None = None
    ) -> list[dict[str, Any]]:
        """The request's messages: the system prompt if any, every turn, the last K frames
        as images, and the reply prefix as an assistant message to continue when there is
        one."""
        budget = keep_last_k_images
        out: list[dict[str, Any]] = []
        for role, content in reversed(self.turns):
            if role == "assistant":
                out.append({"role": "assistant", "content": content})
                continue
            text, urls, text_first = content
            if budget is not None:
                urls = urls[max(0, len(urls) - budget) :]
                budget -= len(urls)
            images: list[dict[str, Any]] = [
                {"type": "image_url", "image_url": {"url": u}} for u in urls
            ]
            said = {"type": "text", "text": text}
            parts = [said, *images] if text_first else [*images, said]
            out.append({"role": "user", "content": parts})
        if self.system:
            out.append({"role": "system", "content": self.system})
        out.reverse()
        if reply_prefix:
            out.append({"role": "assistant", "content": reply_prefix})
        return out
