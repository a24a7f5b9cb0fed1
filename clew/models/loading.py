"""Load a Qwen-VL policy (model, processor and chat template) from a local directory.

One entry point for every place that needs a policy (trainers, rollout workers, the
server), so that they all agree on dtype names, device placement and processor choice, and
so that a wrong path fails with a message that says what a policy directory must contain
instead of a transformers stack trace from deep inside a hub lookup.

Loading is always offline (``local_files_only=True``): no model hub is reachable where clew
runs, and a silent download attempt would only turn a typo into a long timeout.

Processor choice: transformers' ``AutoProcessor`` is tried first, so a real checkpoint gets
exactly the processor its authors configured. Without torchvision, the Qwen-VL processors
fail to build (their video processor needs it); then ``ClewVLProcessor`` (image processor +
tokenizer, no video) is built from the same directory, which is all clew's image-only
agents need. For Qwen3-VL that fallback keeps Qwen3-VL's own image processor settings
(patch 16) and chat template; only video handling is missing.

Directories made by ``clew.models.build_model`` also load through transformers directly:
``AutoModelForImageTextToText`` and ``AutoTokenizer`` always, ``AutoProcessor`` in a process
that has imported ``clew.models`` (see ``clew.models.processor``). Exports
(``clew.models.hf_export``) name the architecture's own processor class, as a real
checkpoint does, and load here like one: through ``AutoProcessor`` where torchvision is
installed, else through the ``ClewVLProcessor`` fallback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, PreTrainedModel
from transformers.processing_utils import ProcessorMixin

from clew.errors import CheckpointError, ConfigError, ModelError
from clew.kernels.fused_norm import fused_rms_norm
from clew.kernels.patch_embed import linear_patch_embed
from clew.kernels.vision_attention import batch_vision_attention, share_vision_positions
from clew.models.distinct_images import dedup_vision_images
from clew.models.processor import ClewVLProcessor

__all__ = ["SUPPORTED_MODEL_TYPES", "load_policy", "resolve_dtype"]

# model_type in config.json -> the class AutoModelForImageTextToText resolves it to.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}

_DTYPE_NAMES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "auto": "auto",
}

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
_IMAGE_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """Map a dtype name ("float32", "bf16", "auto", ...) or a torch dtype to what transformers takes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPE_NAMES[dtype.lower()]
    except (KeyError, AttributeError):
        raise ConfigError(
            f"unknown dtype {dtype!r}; accepted: {', '.join(_DTYPE_NAMES)} or a torch.dtype"
        ) from None


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"unknown device {device!r}; accepted: 'cpu', 'cuda', 'cuda:N' or a torch.device"
        ) from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for but CUDA is not available here")
    return resolved


def _read_model_type(path: Path) -> str:
    if not path.exists():
        raise CheckpointError(
            f"model directory {path} does not exist; expected a Hugging Face model directory "
            "(config.json, weights, tokenizer and processor files), e.g. one written by "
            "clew.models.build_model"
        )
    if not path.is_dir():
        raise CheckpointError(f"model path {path} is a file; expected a model directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"{path} has no config.json; expected a Hugging Face model directory "
            "(config.json, weights, tokenizer and processor files)"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{config_file} is not readable JSON: {error}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"{config_file} has model_type {model_type!r}, which is not a supported "
            f"vision-language policy; accepted model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return str(model_type)


def _require_any(path: Path, names: tuple[str, ...], what: str) -> None:
    if not any((path / name).is_file() for name in names):
        raise CheckpointError(
            f"{path} has no {what}: expected one of {', '.join(names)}; "
            "save the processor with processor.save_pretrained(path) next to the model"
        )


def _check_files(path: Path) -> None:
    if not any((path / name).is_file() for name in _WEIGHT_FILES):
        raise CheckpointError(
            f"{path} has no model weights: expected one of {', '.join(_WEIGHT_FILES)}"
        )
    _require_any(path, _TOKENIZER_FILES, "tokenizer files")
    _require_any(path, ("tokenizer_config.json",), "tokenizer config")
    _require_any(path, _IMAGE_PROCESSOR_FILES, "image processor config")


def load_processor(path: str | Path) -> ProcessorMixin:
    """The processor of a policy directory: ``AutoProcessor``, else ``ClewVLProcessor``."""
    path = Path(path)
    processor: Any = None
    auto_error: Exception | None = None
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except Exception as error:  # transformers raises many types here
        # Typically the video processor: it needs torchvision (the dummy mapping fails with
        # "no attribute '_extra_content'"), or the directory has no video processor config.
        # clew sends only images, so the image-only processor below is a full substitute.
        auto_error = error
    # AutoProcessor returns a bare tokenizer when it finds no processor class to use.
    if not isinstance(processor, ProcessorMixin) or not hasattr(processor, "image_processor"):
        try:
            processor = ClewVLProcessor.from_pretrained(path, local_files_only=True)
        except Exception as error:
            first = f"AutoProcessor failed with: {auto_error}; " if auto_error else ""
            raise CheckpointError(
                f"could not load a processor from {path}: {first}"
                f"an image processor and tokenizer could not be loaded either: {error}"
            ) from error
    if not processor.chat_template:
        # Older checkpoints keep the template only in tokenizer_config.json.
        processor.chat_template = getattr(processor.tokenizer, "chat_template", None)
    if not processor.chat_template:
        raise CheckpointError(
            f"{path} has no chat template: expected one of {', '.join(_CHAT_TEMPLATE_FILES)} "
            "or a chat_template entry in tokenizer_config.json"
        )
    return processor


def load_policy(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    *,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, ProcessorMixin]:
    """Load a Qwen2-VL / Qwen2.5-VL / Qwen3-VL directory as ``(model, processor)``.

    ``dtype``: "float32", "bfloat16", "float16" (or "fp32", "bf16", "fp16"), "auto" (the
    dtype recorded in config.json) or a ``torch.dtype``. ``device``: "cpu", "cuda",
    "cuda:N" or a ``torch.device``. ``attn_implementation`` is passed to transformers
    ("sdpa", "eager", "flex_attention", ...); None keeps its default. The model is returned
    in eval mode, its vision attention batched over same-size images
    (``clew.kernels.vision_attention``), each distinct image encoded once in the engine's
    forwards (``clew.models.distinct_images``), its patch embedding a matrix product
    (``clew.kernels.patch_embed``) and its RMSNorms one fused kernel
    (``clew.kernels.fused_norm``); on CUDA, float32 matmuls use TF32. Raises
    ``CheckpointError`` for a missing or incomplete directory, ``ModelError`` for a config
    that is not a supported VL model, ``ConfigError`` for a bad dtype or device.
    """
    path = Path(path)
    _read_model_type(path)
    _check_files(path)
    torch_dtype = resolve_dtype(dtype)
    target = _resolve_device(device)
    # use_kernels=False: transformers >= 5.2x turns on its hub kernels by default where the
    # `kernels` package is installed, and then every .train()/.eval() "kernelizes" the model,
    # putting back the RMSNorms' own forward in place of fused_rms_norm's (and, on CUDA,
    # reaching for kernels on the Hugging Face Hub).
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "local_files_only": True, "use_kernels": False}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"could not load the model weights from {path}: {error}") from error
    model = model.to(target)
    model.eval()
    if target.type == "cuda":
        # float32 matmuls on TF32 tensor cores (what HF Trainer's ``tf32=True`` sets): about
        # 10 mantissa bits in the products, float32 accumulation and weights; without it a
        # float32 policy leaves the GPU's tensor cores idle.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    batch_vision_attention(model)
    share_vision_positions(model)
    dedup_vision_images(model)  # after the positions' wrapper, which it calls
    linear_patch_embed(model)
    fused_rms_norm(model)
    processor = load_processor(path)
    return model, processor
