"""Opening a policy for inference: load the checkpoint (and an adapter), build the engine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from clew.inference.engine import InferenceEngine
from clew.inference.kv_cache import cache_budget_bytes
from clew.models.chat import ChatFormat


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# Host threads for torch's CPU ops in a process that drives an accelerator.
ACCELERATOR_HOST_THREADS = 4


def limit_host_threads(device: torch.device) -> None:
    """On an accelerator, cap torch's CPU thread pool at ``ACCELERATOR_HOST_THREADS``.

    torch sizes its pool to every core. A GPU process's host side is per-row Python and
    small tensors, so the pool buys nothing alone, and two such processes on one machine
    spin their pools against each other: two rollouts at once on one 16-core host were
    measured many times slower each than one alone, and close to it with four threads each,
    while one process plays as fast with 1, 4 or 16 threads. Ray does the same for its
    workers (OMP_NUM_THREADS).
    An explicit ``OMP_NUM_THREADS`` wins; the CPU keeps torch's default.
    """
    if device.type != "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(min(ACCELERATOR_HOST_THREADS, torch.get_num_threads()))


def limit_device_memory(device: torch.device, fraction: float | None) -> None:
    """Cap this process's share of the GPU's memory at ``fraction`` (``None``: no cap).

    torch's caching allocator keeps what a phase freed for the next, so several runs on one
    GPU (``clew train -m --jobs N``) each grow to their own peak and hold it, and the
    others run out of memory. Under the cap the allocator gives cached blocks back before
    claiming more, and a run whose own need exceeds its share fails alone. No effect on a
    CPU."""
    if fraction is not None and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(fraction, device)


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
    cuda_graphs: bool = False,
) -> Policy:
    """The policy of ``model_dir`` (with ``adapter_dir``'s adapter) and its engine;
    ``cuda_graphs``: decode steps replayed from CUDA graphs, where the device is CUDA."""
    from clew.models import load_policy
    from clew.models.adapter_loading import load_adapter

    dev = pick_device(device)
    limit_host_threads(dev)
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    model, processor = load_policy(model_dir, dtype=dtype, device=dev)
    if adapter_dir is not None:
        model = load_adapter(model, adapter_dir)
    model.eval()
    chat = ChatFormat(processor)
    budget = cache_budget_bytes(dev, gpu_memory_utilization, max_cache_mb)
    engine = InferenceEngine(
        model, chat, max_cache_bytes=budget, cuda_graphs=cuda_graphs and dev.type == "cuda"
    )
    return Policy(model, processor, chat, engine)
