"""Full-weight exports as standard Hugging Face Qwen-VL directories.

``clew export --merge`` and the SFT stage's exports write a directory that plain
transformers (``AutoProcessor`` + ``AutoModelForImageTextToText``), vLLM and clew itself
load: the weights in the base checkpoint's dtype, sharded above ``max_shard_size`` with
``model.safetensors.index.json``, and the processor, tokenizer, chat template and
generation config as ``clew.models.hf_files`` writes them.

The dtype: clew trains in float32 (LoRA over a float32 base, or all weights), so a model
saved as it is would be twice the size of a bfloat16 base and would load in a different
dtype than the checkpoint it came from. An export is cast to the dtype the base recorded in
its config.json (clew's own ``build_model`` records the dtype it saved in, float32 by
default); a base that records none keeps the model's own dtype.

Shards: transformers 5 saves up to 50 GB in one file by default; the Hub's Qwen-VL
checkpoints come in shards of about 5 GB, which tools that read one shard at a time expect.
``DEFAULT_MAX_SHARD_SIZE`` is 5 GB (transformers 4's default); ``clew export
--max-shard-size`` changes it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from clew.errors import ConfigError
from clew.models.hf_files import (
    BaseFiles,
    processor_class_for,
    read_base_files,
    write_generation_config,
    write_processor_files,
)

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "base_dir_of",
    "export_dtype",
    "parse_shard_size",
    "read_base_files",
    "save_weights",
    "write_companion_files",
    "write_export",
]

DEFAULT_MAX_SHARD_SIZE = "5GB"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_shard_size(value: str | int) -> int:
    """Bytes from a shard size: an integer (bytes) or a number with a unit, as transformers
    takes them ("5GB", "500MB", "2GiB")."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.match(str(value))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"shard size {value!r} is not a size; accepted: a number of bytes or a number "
                "with a unit (KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 5GB or 500MB"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ConfigError(f"shard size must be positive, got {value!r} (e.g. 5GB)")
    return size


def _config(model: torch.nn.Module) -> Any:
    # A PeftModel forwards attribute lookups to the transformers model it wraps.
    return model.config


def base_dir_of(model: torch.nn.Module) -> Path | None:
    """The directory ``model`` was loaded from (``load_policy`` records it as transformers'
    ``name_or_path``), or None where that is not a model directory any more."""
    name = getattr(_config(model), "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not name or not (Path(name) / "config.json").is_file():
        return None
    return Path(name)


def export_dtype(model: torch.nn.Module, base: BaseFiles) -> torch.dtype:
    """The dtype an export of ``model`` is written in: the base's, else the model's own."""
    if base.dtype in _DTYPES:
        return _DTYPES[base.dtype]
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _cast(state: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``state`` with floating tensors in ``dtype``; tensors that shared memory (tied
    weights) share their cast copy too, so transformers still recognises them as tied."""
    memo: dict[tuple[Any, ...], torch.Tensor] = {}
    out: dict[str, Any] = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == dtype:
            out[name] = t
            continue
        key = (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key not in memo:
            memo[key] = t.detach().to(dtype)
        out[name] = memo[key]
    return out


def _record_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """config.json's dtype entries (top level and any sub-config) set to ``dtype``:
    ``save_pretrained`` records the dtype of the module it is called on, not of the
    tensors it was handed."""
    name = str(dtype).removeprefix("torch.")
    config = json.loads(config_file.read_text())
    for part in (config, *(v for v in config.values() if isinstance(v, dict))):
        for key in ("dtype", "torch_dtype"):
            if key in part:
                part[key] = name
    config["dtype"] = name
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_weights(
    model: torch.nn.Module,
    directory: str | Path,
    dtype: torch.dtype,
    *,
    state_dict: Mapping[str, Any] | None = None,
    owned: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """``model``'s config and weights (``state_dict`` where given) in ``dtype``, sharded above
    ``max_shard_size``. ``owned``: ``model`` is a throwaway copy (a merged export's) and is
    cast in place; otherwise the weights are cast as they are written and ``model`` is left
    in its own dtype (a worker's training weights)."""
    parse_shard_size(max_shard_size)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if owned:
        model.to(dtype)
        if state_dict is not None:
            state_dict = _cast(state_dict, dtype)
    else:
        state_dict = _cast(model.state_dict() if state_dict is None else state_dict, dtype)
    model.save_pretrained(out, state_dict=state_dict, max_shard_size=max_shard_size)
    _record_dtype(out / "config.json", dtype)


def write_companion_files(
    model: torch.nn.Module, processor: Any, directory: str | Path, base: BaseFiles | None = None
) -> None:
    """Everything of an export but the weights: the processor, tokenizer and chat template
    under the architecture's own processor class, and generation_config.json
    (``clew.models.hf_files``). ``base``: what to keep of the base checkpoint (default: read
    from the directory ``model`` was loaded from)."""
    if base is None:
        base = read_base_files(base_dir_of(model))
    config = _config(model)
    model_type = str(getattr(config, "model_type", ""))
    processor_class_for(model_type)  # an unexportable model fails before anything is written
    write_processor_files(processor, directory, model_type, base)
    text_config = getattr(config, "text_config", config)
    write_generation_config(directory, processor.tokenizer, text_config, base)


def write_export(
    model: torch.nn.Module,
    processor: Any,
    directory: str | Path,
    *,
    base_dir: str | Path | None = None,
    state_dict: Mapping[str, Any] | None = None,
    owned: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """``model`` (full weights: any adapter merged in) and ``processor`` as a standard
    Hugging Face directory; ``base_dir``: the checkpoint it was trained from (default: the
    one it was loaded from), whose dtype, generation config and chat-template file it keeps.
    ``state_dict``/``owned``: as for ``save_weights``. Returns the directory."""
    base = read_base_files(base_dir if base_dir is not None else base_dir_of(model))
    processor_class_for(str(getattr(_config(model), "model_type", "")))
    out = Path(directory)
    save_weights(
        model,
        out,
        export_dtype(model, base),
        state_dict=state_dict,
        owned=owned,
        max_shard_size=max_shard_size,
    )
    write_companion_files(model, processor, out, base)
    return out
