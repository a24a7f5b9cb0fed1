"""Episode tokens in Qwen's ChatML layout, built turn by turn without re-tokenizing.

A multi-turn episode is a token sequence that only grows: the first user turn (image +
task text), the model's reply (the sampled tokens, kept as they were sampled), the next
user turn (image + feedback), and so on. The rollout engine, SFT and the trainer all build
sequences through ``ChatFormat`` so they agree token for token. Every Qwen-VL checkpoint's
chat template uses this ChatML layout (``<|im_start|>role\\n ... <|im_end|>\\n``, images as
``<|vision_start|><|image_pad|>*N<|vision_end|>``); building the segments here rather than
re-rendering the template over the whole history is what keeps sampled tokens exact.

Text that comes from outside the layout (a turn's text, a system prompt, a reply) is encoded
as plain text: a special-token string in it, such as ``"<|im_end|>"`` or ``"<|image_pad|>"``,
becomes the tokens of its characters, never the control token, as OpenAI's API and the
tokenizers' ``split_special_tokens`` treat it. Otherwise a user's text could close its turn
and open another, or add image tokens that no image fills. Only the layout's own scaffolding
(``<|im_start|>user\\n``, ``<|im_end|>``, the vision tokens around an image) is special.
Text without a special-token string encodes exactly as before, through one cache.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from clew.models.chat_template import check_special_tokens, template_system_prompt
from clew.models.pixels import Pixels, cat_pixels, fast_frames, fast_grid, fast_patches

_TOKEN_CACHE_SIZE = 4096


@dataclass
class Chunk:
    """Tokens to append to one sequence, with the pixels of the images among them."""

    token_ids: list[int]
    pixel_values: Pixels | None = None  # patches [patches, C * T * P * P], or Frames
    image_grid_thw: torch.Tensor | None = None  # [images, 3]

    @property
    def num_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])


def join_chunks(chunks: list[Chunk]) -> Chunk:
    """One chunk holding ``chunks`` in order (pixels and grids concatenated likewise)."""
    ids = [t for c in chunks for t in c.token_ids]
    pix = [c.pixel_values for c in chunks if c.pixel_values is not None]
    grids = [c.image_grid_thw for c in chunks if c.image_grid_thw is not None]
    return Chunk(ids, cat_pixels(pix) if pix else None, torch.cat(grids) if grids else None)


def special_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """The texts the tokenizer reads as special tokens (its added tokens marked special and
    its named special tokens)."""
    found = {
        str(getattr(t, "content", t))
        for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
        if getattr(t, "special", False)
    }
    found.update(str(t) for t in getattr(tokenizer, "all_special_tokens", ()) or ())
    return tuple(sorted(t for t in found if t))


class ChatFormat:
    """Encodes user turns for a Qwen-VL processor; knows the special token ids."""

    def __init__(self, processor, system_prompt: str | None = None) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        tok = self.tokenizer
        ids = check_special_tokens(tok)
        self.im_start_id = ids["<|im_start|>"]
        self.im_end_id = ids["<|im_end|>"]
        self.image_token_id = ids["<|image_pad|>"]
        self.vision_start_id = ids["<|vision_start|>"]
        self.vision_end_id = ids["<|vision_end|>"]
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.im_end_id
        # The ids that end a reply: <|im_end|> and the tokenizer's eos; the engine adds the
        # model's generation_config eos ids (``add_stop_ids``).
        self.stop_token_ids: tuple[int, ...] = ()
        self.add_stop_ids([self.im_end_id, tok.eos_token_id])
        self.merge_size = int(getattr(self.image_processor, "merge_size", 2))
        # None: the chat template's own default, as apply_chat_template gives it; "": none.
        self.system_prompt = template_system_prompt(tok) if system_prompt is None else system_prompt
        self._token_cache: dict[str, tuple[int, ...]] = {}
        self._plain_cache: dict[str, tuple[int, ...]] = {}
        self._specials = special_token_strings(tok)
        self._special_ids = {
            i for i in (tok.convert_tokens_to_ids(t) for t in self._specials) if i is not None
        }
        self._newline = self._encode("\n")
        self._assistant_header = self._encode("<|im_start|>assistant\n")

    def _encode(self, text: str) -> list[int]:
        # Turn texts repeat (the same headers and feedback lines, episode after episode);
        # tokenizing each anew was a large share of the time of building SFT demonstrations.
        ids = self._token_cache.get(text)
        if ids is None:
            if len(self._token_cache) >= _TOKEN_CACHE_SIZE:
                self._token_cache.clear()
            ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            self._token_cache[text] = ids
        return list(ids)

    def _plain(self, text: str) -> list[int]:
        """``text`` as plain text: special-token strings in it as the tokens of their
        characters (module docstring); the same ids as ``_encode`` for any other text."""
        if not text:
            return []
        if not any(special in text for special in self._specials):
            return self._encode(text)
        ids = self._plain_cache.get(text)
        if ids is None:
            if len(self._plain_cache) >= _TOKEN_CACHE_SIZE:
                self._plain_cache.clear()
            encoded = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)
            ids = tuple(encoded["input_ids"])
            if self._special_ids.intersection(ids):  # a tokenizer that ignores the flag
                ids = tuple(self._split_specials(text))
            self._plain_cache[text] = ids
        return list(ids)

    def _split_specials(self, text: str) -> list[int]:
        """``text`` with each special-token string cut after its first character, so that
        no piece is a special token (for tokenizers without ``split_special_tokens``)."""
        pattern = "|".join(re.escape(s) for s in sorted(self._specials, key=len, reverse=True))
        ids: list[int] = []
        for piece in re.split(f"({pattern})", text):
            if piece in self._specials:
                ids += self._encode(piece[:1]) + self._encode(piece[1:])
            elif piece:
                ids += self._encode(piece)
        return ids

    def system_turn(self, prompt: str) -> list[int]:
        """A system turn holding ``prompt`` as plain text (``<|im_start|>system\\n ...
        <|im_end|>\\n``)."""
        if not any(special in prompt for special in self._specials):
            return self._encode(f"<|im_start|>system\n{prompt}<|im_end|>\n")
        return [
            *self._encode("<|im_start|>system\n"),
            *self._plain(prompt),
            *self._encode("<|im_end|>\n"),
        ]

    def encode_images(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        fast = fast_patches(images, self.image_processor)
        if fast is not None:
            return fast
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def encode_frames(self, images: list[Image.Image]) -> tuple[Pixels, torch.Tensor]:
        """As ``encode_images``, but as ``Frames`` (patched on the model's device) where covered."""
        frames = fast_frames(images, self.image_processor)
        return self.encode_images(images) if frames is None else (frames, frames.grid())

    def image_token_count(self, grid_thw: torch.Tensor) -> int:
        """Placeholder tokens of one image's grid ``[3]``, or of all the images of ``[N, 3]``
        (each image's count is a whole number of merges, so the counts add up)."""
        return int(grid_thw.prod(dim=-1).sum()) // (self.merge_size**2)

    def user_turn(
        self,
        text: str,
        images: list[Image.Image],
        *,
        first: bool,
        after_reply_end: bool = True,
        pixels: bool = True,
        text_first: bool = False,
        system: str | None = None,
    ) -> Chunk:
        """The tokens of a user turn followed by the assistant header.

        ``first``: the episode's opening turn (with the system prompt, if any: ``system``
        where given, else the one this format was made with).
        ``after_reply_end``: the previous reply ended with ``<|im_end|>`` (else it is closed here).
        ``text_first``: the text before the images (VisGym's SFT data puts the image first,
        SkyRL's VisGym env the text first); by default the images come first.
        ``pixels=False``: the caller keeps the images and needs only the tokens; the chunk
        then carries the grids but no pixel values where that saves encoding them. Pixel
        values come as ``Frames`` where the fast path covers the images (``as_patches``).
        """
        parts: list[str | Image.Image] = [text, *images] if text_first else [*images, text]
        return self.user_parts(
            parts, first=first, after_reply_end=after_reply_end, pixels=pixels, system=system
        )

    def observation_turn(
        self, obs: Any, *, first: bool, after_reply_end: bool = True, pixels: bool = True
    ) -> Chunk:
        """``user_turn`` for an env's ``Observation``, in the order and with the system
        prompt its prompt format gives (``text_first``, ``system``)."""
        return self.user_turn(
            obs.text,
            obs.images,
            first=first,
            after_reply_end=after_reply_end,
            pixels=pixels,
            text_first=getattr(obs, "text_first", False),
            system=getattr(obs, "system", None),
        )

    def user_parts(
        self,
        parts: Sequence[str | Image.Image],
        *,
        first: bool,
        after_reply_end: bool = True,
        pixels: bool = True,
        system: str | None = None,
    ) -> Chunk:
        """A user turn of text and images in the order given, as the chat template renders
        it: each image as ``<|vision_start|><|image_pad|>*N<|vision_end|>``, text parts
        written as they are with nothing between them (adjacent text parts are tokenized
        together, as the template's rendered string is), as plain text (module docstring).
        Arguments as ``user_turn``."""
        ids: list[int] = []
        if not first:
            ids += self._newline if after_reply_end else [self.im_end_id, *self._newline]
        else:
            prompt = self.system_prompt if system is None else system
            if prompt:
                ids += self.system_turn(prompt)
        ids += self._encode("<|im_start|>user\n")
        images = [p for p in parts if not isinstance(p, str)]
        pixel_values = grid = None
        if images:
            grid = None if pixels else fast_grid(images, self.image_processor)
            if grid is None:
                pixel_values, grid = self.encode_frames(images)
        merged = self.merge_size**2
        counts = iter([] if grid is None else [n // merged for n in grid.prod(-1).tolist()])
        text = ""
        for part in parts:
            if isinstance(part, str):
                text += part
                continue
            ids += self._plain(text)
            text = ""
            ids += [self.vision_start_id, *[self.image_token_id] * next(counts), self.vision_end_id]
        ids += self._plain(text)
        ids += [self.im_end_id, *self._newline, *self._assistant_header]
        return Chunk(ids, pixel_values, grid)

    def reply_tokens(self, text: str) -> list[int]:
        """A reply as the model should write it (for demonstrations): ``text``, as plain
        text, then ``<|im_end|>``."""
        return self._plain(text) + [self.im_end_id]

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added; a special-token string in it is
        that token: for the layout's own pieces and configured texts); ``[]`` for ``""``."""
        return list(self._encode(text)) if text else []

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: a special-token string in it is the tokens of
        its characters (for text a client sent); ``[]`` for ``""``."""
        return self._plain(text)

    def add_stop_ids(self, ids: int | Sequence[int | None] | None) -> None:
        """Also end replies on ``ids`` (an id, a list of them, as ``generation_config``'s
        ``eos_token_id`` is either; None entries are skipped)."""
        more = [ids] if isinstance(ids, int) else list(ids or ())
        for i in more:
            if i is not None and int(i) >= 0 and int(i) not in self.stop_token_ids:
                self.stop_token_ids += (int(i),)

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` without special tokens; a reply's closing stop id (one
        of ``stop_token_ids``) is left out even where it is not a special token."""
        if token_ids and token_ids[-1] in self.stop_token_ids:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
