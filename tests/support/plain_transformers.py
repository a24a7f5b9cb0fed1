"""Load a clew export as a user without clew would, and report what it computes.

Run as a script in a process that never imports clew (``tests/models/test_export.py`` starts it),
so that nothing clew registers with transformers (its processor class, its model patches)
can make an export look loadable when it is not. Three commands, each writing JSON or a
tensor file for the test to compare with clew's own results:

- ``generate DIR IMAGE PROMPT N OUT``: ``AutoProcessor`` + ``AutoModelForImageTextToText``
  on DIR, the chat template over one user turn (the image, then the prompt), greedy
  generation of up to N tokens; writes ``{"input_ids": [...], "tokens": [...]}``.
  ``AutoProcessor`` builds the Qwen-VL video processor, which needs torchvision.
- ``generate-inputs DIR INPUTS N OUT``: the same model and generation, on inputs saved
  with ``torch.save`` (built by clew's processor): needs no processor, so no torchvision.
- ``peft-logits BASE ADAPTER INPUTS OUT``: the base through ``AutoModelForImageTextToText``,
  the adapter through ``peft.PeftModel.from_pretrained``; saves the logits on INPUTS.

Generation suppresses the vision placeholder tokens, as clew's engine does (it never
samples them: ``clew.models.logit_masks``); everything is float32 on the CPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

_VISION_TOKENS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>")


def _model(path: str) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, local_files_only=True
    ).eval()


def _greedy(path: str, inputs: dict[str, torch.Tensor], max_new_tokens: int) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    suppress = [tokenizer.convert_tokens_to_ids(t) for t in _VISION_TOKENS]
    with torch.no_grad():
        out = _model(path).generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            suppress_tokens=[i for i in suppress if isinstance(i, int)],
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def generate(path: str, image: str, prompt: str, max_new_tokens: str, out: str) -> None:
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    frame = Image.open(image).convert("RGB")
    inputs = dict(processor(text=[text], images=[frame], return_tensors="pt"))
    tokens = _greedy(path, inputs, int(max_new_tokens))
    result = {
        "input_ids": inputs["input_ids"][0].tolist(),
        "tokens": tokens,
        "processor": type(processor).__name__,
        "image_processor": type(processor.image_processor).__name__,
    }
    Path(out).write_text(json.dumps(result))


def generate_inputs(path: str, inputs: str, max_new_tokens: str, out: str) -> None:
    saved = torch.load(inputs)
    Path(out).write_text(json.dumps({"tokens": _greedy(path, saved, int(max_new_tokens))}))


def peft_logits(base: str, adapter: str, inputs: str, out: str) -> None:
    from peft import PeftModel

    model = PeftModel.from_pretrained(_model(base), adapter).eval()
    with torch.no_grad():
        logits = model(**torch.load(inputs)).logits
    torch.save(logits, out)


if __name__ == "__main__":
    commands = {
        "generate": generate,
        "generate-inputs": generate_inputs,
        "peft-logits": peft_logits,
    }
    assert "clew" not in sys.modules
    commands[sys.argv[1]](*sys.argv[2:])
    assert "clew" not in sys.modules, "the plain-transformers check imported clew"
