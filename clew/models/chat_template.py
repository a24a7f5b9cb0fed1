"""What a checkpoint's tokenizer and chat template must offer clew's chat layout.

clew lays episodes out in Qwen's ChatML tokens itself (``clew.models.chat``) rather than
re-rendering the template over the whole history, so it checks once, when a processor is
turned into a ``ChatFormat``, that the checkpoint speaks that layout: the special tokens
exist as single tokens, and the chat template renders an image as
``<|vision_start|><|image_pad|><|vision_end|>`` inside ChatML turns. A checkpoint that does
not fails here, naming the file to fix, instead of training on a prompt the model was never
shown. The template's default system prompt (Qwen2-VL's and Qwen2.5-VL's add "You are a
helpful assistant." to a conversation without one; Qwen3-VL's add none) is read off the
template, so a format with no system prompt of its own gets what ``apply_chat_template``
would give.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clew.errors import ModelError

SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|image_pad|>",
    "<|vision_end|>",
)
IMAGE_LAYOUT = "<|vision_start|><|image_pad|><|vision_end|>"
_SYSTEM_OPEN = "<|im_start|>system\n"
_PROBE = "\u2063probe"  # text no template rewrites


def _where(tokenizer: Any, names: tuple[str, ...]) -> str:
    folder = getattr(tokenizer, "name_or_path", "") or ""
    for name in names:
        if folder and (Path(folder) / name).is_file():
            return str(Path(folder) / name)
    return f"the tokenizer of {folder!r}" if folder else "the tokenizer"


def check_special_tokens(tokenizer: Any) -> dict[str, int]:
    """The ids of the ChatML and vision tokens; a tokenizer lacking one fails naming it."""
    ids, missing = {}, []
    unk = getattr(tokenizer, "unk_token_id", None)
    for token in SPECIAL_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or (tid == unk and token != getattr(tokenizer, "unk_token", None)):
            missing.append(token)
        else:
            ids[token] = int(tid)
    if missing:
        where = _where(tokenizer, ("tokenizer.json", "tokenizer_config.json"))
        raise ModelError(
            f"{where} has no token {', '.join(missing)}: clew's chat layout (Qwen's ChatML with "
            f"vision tokens) needs each of {', '.join(SPECIAL_TOKENS)} as one token; use a "
            "Qwen2-VL, Qwen2.5-VL or Qwen3-VL tokenizer"
        )
    return ids


def template_system_prompt(tokenizer: Any) -> str | None:
    """The system prompt the chat template adds to a conversation that has none, or None
    (also where the checkpoint has no template). A template that does not render ChatML
    images fails naming its file."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    where = _where(
        tokenizer, ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
    )
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _PROBE}]}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - any template error is the checkpoint's
        raise ModelError(
            f"the chat template in {where} cannot render an image turn: {exc}"
        ) from None
    if IMAGE_LAYOUT not in text or "<|im_start|>user\n" not in text:
        raise ModelError(
            f"the chat template in {where} does not render a user image as {IMAGE_LAYOUT} in "
            "a '<|im_start|>user' turn, the layout clew's rollouts and SFT use: use the "
            "checkpoint family's own template (Qwen2-VL, Qwen2.5-VL or Qwen3-VL)"
        )
    if not text.startswith(_SYSTEM_OPEN):
        return None
    end = text.find("<|im_end|>", len(_SYSTEM_OPEN))
    return text[len(_SYSTEM_OPEN) : end] if end >= 0 else None
