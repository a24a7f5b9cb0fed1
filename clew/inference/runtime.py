"""Opening a policy for inference: load the checkpoint (and an adapter), build the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from clew.inference.engine import InferenceEngine, cache_budget_bytes
from clew.models.chat import ChatFormat


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class Policy:
    model: torch.nn.Module
    processor: object
    chat: ChatFormat
    engine: InferenceEngine


def open_policy(
    model_dir: str | Path,
    adapter_dir: str | Path | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    gpu_memory_utilization: float = 0.45,
    max_cache_mb: int = 4096,
) -> Policy:
    from clew.models import load_policy
    from clew.models.adapters import load_adapter

    dev = pick_device(device)
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    model, processor = load_policy(model_dir, dtype=dtype, device=dev)
    if adapter_dir is not None:
        model = load_adapter(model, adapter_dir)
    model.eval()
    chat = ChatFormat(processor)
    budget = cache_budget_bytes(dev, gpu_memory_utilization, max_cache_mb)
    return Policy(model, processor, chat, InferenceEngine(model, chat, max_cache_bytes=budget))
