"""Loading LoRA adapters onto a base policy, with errors that say what does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from clew.errors import ModelError


def load_adapter(
    model: torch.nn.Module, adapter_dir: str | Path, name: str = "default"
) -> torch.nn.Module:
    """``model`` wrapped by peft with the adapter of ``adapter_dir`` (inference mode)."""
    from peft import PeftModel

    path = Path(adapter_dir)
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise ModelError(
            f"{path} is not a LoRA adapter directory: expected adapter_config.json and "
            "adapter_model.safetensors (as written by `clew train` exports)"
        )
    cfg = json.loads(cfg_file.read_text())
    try:
        return PeftModel.from_pretrained(model, str(path), adapter_name=name, is_trainable=False)
    except (ValueError, RuntimeError, KeyError) as exc:
        raise ModelError(
            f"the adapter in {path} (rank {cfg.get('r')}, target modules "
            f"{cfg.get('target_modules')}) does not fit this base model: {str(exc).splitlines()[0]}"
        ) from None
