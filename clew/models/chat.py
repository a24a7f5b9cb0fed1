"""Episode tokens in Qwen's ChatML layout, built turn by turn without re-tokenizing.

A multi-turn episode is a token sequence that only grows: the first user turn (image +
task text), the model's reply (the sampled tokens, kept as they were sampled), the next
user turn (image + feedback), and so on. The rollout engine, SFT and the trainer all build
sequences through ``ChatFormat`` so they agree token for token. Every Qwen-VL checkpoint's
chat template uses this ChatML layout (``<|im_start|>role\\n ... <|im_end|>\\n``, images as
``<|vision_start|><|image_pad|>*N<|vision_end|>``); building the segments here rather than
re-rendering the template over the whole history is what keeps sampled tokens exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image

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


class ChatFormat:
    """Encodes user turns for a Qwen-VL processor; knows the special token ids."""

    def __init__(self, processor, system_prompt: str | None = None) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        tok = self.tokenizer
        self.im_start_id = tok.convert_tokens_to_ids("<|im_start|>")
        self.im_end_id = tok.convert_tokens_to_ids("<|im_end|>")
        self.image_token_id = tok.convert_tokens_to_ids("<|image_pad|>")
        self.vision_start_id = tok.convert_tokens_to_ids("<|vision_start|>")
        self.vision_end_id = tok.convert_tokens_to_ids("<|vision_end|>")
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.im_end_id
        self.merge_size = int(getattr(self.image_processor, "merge_size", 2))
        self.system_prompt = system_prompt
        self._token_cache: dict[str, tuple[int, ...]] = {}
        self._newline = self._encode("\n")
        self._assistant_header = self._encode("<|im_start|>assistant\n")

    def _encode(self, text: str) -> list[int]:
        # Turn texts repeat (the same headers and feedback lines, episode after episode);
        # tokenizing each anew was a third of the time of building SFT demonstrations.
        ids = self._token_cache.get(text)
        if ids is None:
            if len(self._token_cache) >= _TOKEN_CACHE_SIZE:
                self._token_cache.clear()
            ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            self._token_cache[text] = ids
        return list(ids)

    def encode_images(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        fast = fast_patches(images, self.image_processor)
        if fast is not None:
            return fast
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def encode_frames(self, images: list[Image.Image]) -> tuple[Pixels, torch.Tensor]:
        """As ``encode_images``, but as ``Frames`` (patched on the model's device) where covered."""
        frames = fast_frames(images, self.image_processor)
        if frames is None:
            return self.encode_images(images)
        grid = fast_grid(images, self.image_processor)
        assert grid is not None
        return frames, grid

    def image_token_count(self, grid_thw: torch.Tensor) -> int:
        return int(grid_thw.prod().item()) // (self.merge_size**2)

    def user_turn(
        self,
        text: str,
        images: list[Image.Image],
        *,
        first: bool,
        after_reply_end: bool = True,
        pixels: bool = True,
    ) -> Chunk:
        """The tokens of a user turn followed by the assistant header.

        ``first``: the episode's opening turn (with the system prompt, if any).
        ``after_reply_end``: the previous reply ended with ``<|im_end|>`` (else it is closed here).
        ``pixels=False``: the caller keeps the images and needs only the tokens; the chunk
        then carries the grids but no pixel values where that saves encoding them. Pixel
        values come as ``Frames`` where the fast path covers the images (``as_patches``).
        """
        ids: list[int] = []
        if not first:
            ids += self._newline if after_reply_end else [self.im_end_id, *self._newline]
        elif self.system_prompt:
            ids += self._encode(f"<|im_start|>system\n{self.system_prompt}<|im_end|>\n")
        ids += self._encode("<|im_start|>user\n")
        pixel_values = grid = None
        if images:
            grid = None if pixels else fast_grid(images, self.image_processor)
            if grid is None:
                pixel_values, grid = self.encode_frames(images)
            for g in grid:
                ids += [self.vision_start_id]
                ids += [self.image_token_id] * self.image_token_count(g)
                ids += [self.vision_end_id]
        ids += self._encode(text) + [self.im_end_id] + self._newline + self._assistant_header
        return Chunk(ids, pixel_values, grid)

    def reply_tokens(self, text: str) -> list[int]:
        """A reply as the model should write it (for demonstrations): text then ``<|im_end|>``."""
        return self._encode(text) + [self.im_end_id]

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain ``text`` (no special tokens added); ``[]`` for ``""``."""
        return list(self._encode(text)) if text else []

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
