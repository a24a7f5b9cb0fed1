"""The non-weight files of an export, written as transformers writes them for a real checkpoint.

A policy directory saved straight from clew's processor records ``processor_class:
ClewVLProcessor`` (``clew.models.processor``), which only a process that imported clew can
resolve: elsewhere ``AutoProcessor`` returns a bare tokenizer and the model then fails for
want of ``image_grid_thw``. An export must load anywhere, so its processor files name the
architecture's own processor (``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``,
``Qwen3VLProcessor``).

Why the JSON is written here instead of by ``Qwen3VLProcessor(...).save_pretrained``: those
processors cannot be built without torchvision (their video processor needs it), and clew
runs without it. So the files come from clew's own processor's ``save_pretrained`` (the
tokenizer, its config, the chat template and ``processor_config.json``, as transformers
writes them) and are then given what the real processor would have written:

- ``processor_class`` in ``processor_config.json`` and ``tokenizer_config.json``: the
  architecture's processor;
- a ``video_processor`` entry in ``processor_config.json``: the base's own, where it had one
  (``processor_config.json`` or ``video_preprocessor_config.json``), else the processor's
  own (where torchvision let transformers build a real Qwen-VL processor), else the
  architecture's video processor with the image processor's patch geometry and
  normalization (the rest at that class's defaults), so a loader that builds the video
  processor builds the right one;
- ``preprocessor_config.json`` and ``video_preprocessor_config.json``: the same image and
  video settings flat, the layout of the checkpoints on the Hub, read by loaders that predate
  ``processor_config.json`` (transformers 4, vLLM);
- the chat template as ``chat_template.json`` where the base kept it so, else
  ``chat_template.jinja``;
- ``generation_config.json``: the base's where it had one, else one that stops on
  ``<|im_end|>`` and the tokenizer's eos.

The image processor settings are those of the processor clew used (resize bounds, patch and
merge size, mean and std), typed ``Qwen2VLImageProcessor`` as on every Qwen-VL checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers

from clew.errors import ModelError

__all__ = [
    "PROCESSOR_CLASSES",
    "BaseFiles",
    "read_base_files",
    "write_generation_config",
    "write_processor_files",
]

# model_type -> the processor (and video processor) class transformers pairs with it.
PROCESSOR_CLASSES: dict[str, str] = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "qwen3_vl_moe": "Qwen3VLProcessor",
}
_VIDEO_PROCESSOR_CLASSES: dict[str, str] = {
    "qwen2_vl": "Qwen2VLVideoProcessor",
    "qwen2_5_vl": "Qwen2VLVideoProcessor",
    "qwen3_vl": "Qwen3VLVideoProcessor",
    "qwen3_vl_moe": "Qwen3VLVideoProcessor",
}
_IMAGE_PROCESSOR_TYPE = "Qwen2VLImageProcessor"
# Image settings a video processor shares with the image processor of the same model.
_SHARED_VIDEO_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")

PROCESSOR_CONFIG = "processor_config.json"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
VIDEO_PREPROCESSOR_CONFIG = "video_preprocessor_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"


@dataclass(frozen=True)
class BaseFiles:
    """What an export keeps of the base checkpoint it was trained from.

    ``dtype``: the base's weight dtype name (config.json ``dtype`` / ``torch_dtype``, at the
    top or in ``text_config``), None where it records none; ``generation_config``: the text
    of its generation_config.json; ``video_processor``: its video processor settings;
    ``chat_template_json``: it kept the chat template in chat_template.json (the older
    layout) rather than chat_template.jinja.
    """

    dtype: str | None = None
    generation_config: str | None = None
    video_processor: dict[str, Any] | None = None
    chat_template_json: bool = False


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ModelError(f"{path} is not readable JSON: {error}") from None
    return data if isinstance(data, dict) else None


def _read_text(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_base_files(base_dir: str | Path | None) -> BaseFiles:
    """The parts of ``base_dir`` an export keeps; an empty ``BaseFiles`` for None or a path
    that is not a model directory (the export then writes its own defaults)."""
    if base_dir is None or not (Path(base_dir) / "config.json").is_file():
        return BaseFiles()
    base = Path(base_dir)
    config = _read_json(base / "config.json") or {}
    # transformers 4.57 (the Hub's Qwen3-VL files) records the dtype in text_config only.
    text = config.get("text_config")
    dtype = next(
        (
            part.get(key)
            for part in (config, text if isinstance(text, dict) else {})
            for key in ("dtype", "torch_dtype")
            if part.get(key)
        ),
        None,
    )
    video = (_read_json(base / PROCESSOR_CONFIG) or {}).get("video_processor")
    if not isinstance(video, dict):
        video = _read_json(base / VIDEO_PREPROCESSOR_CONFIG)
    return BaseFiles(
        dtype=dtype if isinstance(dtype, str) else None,
        generation_config=_read_text(base / GENERATION_CONFIG),
        video_processor=video,
        chat_template_json=(base / CHAT_TEMPLATE_JSON).is_file()
        and not (base / CHAT_TEMPLATE_JINJA).is_file(),
    )


def processor_class_for(model_type: str) -> str:
    """The transformers processor class of ``model_type``; a clear error for any other."""
    try:
        return PROCESSOR_CLASSES[model_type]
    except KeyError:
        raise ModelError(
            f"cannot export a model of type {model_type!r}: no standard processor is known for "
            f"it; accepted model types: {', '.join(PROCESSOR_CLASSES)}"
        ) from None


def _video_processor(
    model_type: str, image: dict[str, Any], saved: Any, base: BaseFiles
) -> dict[str, Any]:
    """The base's video processor settings, else those the processor saved (a real Qwen-VL
    processor has a video processor), else the image processor's patch geometry and
    normalization."""
    if base.video_processor is not None:
        video = {k: v for k, v in base.video_processor.items() if k != "processor_class"}
    elif isinstance(saved, dict):
        video = {k: v for k, v in saved.items() if k != "processor_class"}
    else:
        video = {k: image[k] for k in _SHARED_VIDEO_KEYS if k in image}
    video["video_processor_type"] = _VIDEO_PROCESSOR_CLASSES[model_type]
    return video


def write_processor_files(
    processor: Any, directory: str | Path, model_type: str, base: BaseFiles
) -> None:
    """Save ``processor`` to ``directory`` as the architecture's own processor would be saved
    (module docstring); clew's ``load_processor`` reads the result back too."""
    name = processor_class_for(model_type)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(out)

    composite = _read_json(out / PROCESSOR_CONFIG) or {}
    image = composite.get("image_processor")
    if not isinstance(image, dict):
        image = processor.image_processor.to_dict()
    image = {k: v for k, v in image.items() if k not in ("processor_class", "auto_map")}
    image["image_processor_type"] = _IMAGE_PROCESSOR_TYPE
    video = _video_processor(model_type, image, composite.get("video_processor"), base)
    composite.update(image_processor=image, video_processor=video, processor_class=name)
    _write_json(out / PROCESSOR_CONFIG, composite)
    _write_json(out / PREPROCESSOR_CONFIG, {**image, "processor_class": name})
    _write_json(out / VIDEO_PREPROCESSOR_CONFIG, {**video, "processor_class": name})

    tokenizer_config = _read_json(out / TOKENIZER_CONFIG)
    if tokenizer_config is not None:
        tokenizer_config["processor_class"] = name
        _write_json(out / TOKENIZER_CONFIG, tokenizer_config)

    template = processor.chat_template or getattr(processor.tokenizer, "chat_template", None)
    if isinstance(template, str):
        if base.chat_template_json:
            (out / CHAT_TEMPLATE_JINJA).unlink(missing_ok=True)
            _write_json(out / CHAT_TEMPLATE_JSON, {"chat_template": template})
        else:
            (out / CHAT_TEMPLATE_JINJA).write_text(template)


def write_generation_config(
    directory: str | Path, tokenizer: Any, text_config: Any, base: BaseFiles
) -> None:
    """The base's generation_config.json, else one that stops where clew's engine does:
    ``<|im_end|>`` (end of turn) and the tokenizer's eos, greedy unless a caller samples."""
    out = Path(directory) / GENERATION_CONFIG
    if base.generation_config is not None:
        out.write_text(base.generation_config)
        return
    eos: list[int] = []
    for token_id in (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id):
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id not in eos:
            eos.append(token_id)
    config: dict[str, Any] = {"eos_token_id": eos, "do_sample": False}
    bos = getattr(text_config, "bos_token_id", None)
    if bos is not None:
        config["bos_token_id"] = bos
    if tokenizer.pad_token_id is not None:
        config["pad_token_id"] = tokenizer.pad_token_id
    config["transformers_version"] = transformers.__version__
    _write_json(out, config)
