"""How data-parallel policy workers agree: the gradient sync and its process group.

Each of N workers holds the same weights and its share of every mini-batch
(``TrainingBatch.split``). ``PolicyWorker`` asks its ``sync`` for the mini-batch's global
token and sequence counts (so each worker's losses are scaled as one worker's would be) and,
before clipping, for the sum of the gradients over workers; every worker then takes the
same optimizer step. ``TorchDistributedSync`` does this with ``torch.distributed`` (gloo on
CPU, NCCL on CUDA) over the trainable parameters only: with LoRA only the adapter's
gradients travel.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class GradSync(Protocol):
    """How data-parallel workers agree. Every worker makes the same calls in the same order
    (one with nothing to learn from included), or they wait for each other forever."""

    def total(self, x: float) -> float:
        """The sum of ``x`` over all workers."""
        ...

    def reduce_(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace each parameter's ``.grad`` (None counts as zeros) by its sum over workers."""
        ...


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), "lo")


class TorchDistributedSync:
    """``GradSync`` over the default ``torch.distributed`` process group."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @classmethod
    def join(
        cls,
        init_method: str,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float = 300.0,
    ) -> TorchDistributedSync:
        """Join the group at ``init_method``: ``tcp://host:port`` (rank 0 listens there) or
        ``file://path`` (workers of one machine: ``local_rendezvous``)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        parsed = urlparse(init_method)
        if backend == "gloo" and (parsed.scheme == "file" or parsed.hostname in LOOPBACK):
            # Gloo otherwise listens on the address the host name resolves to.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        return cls(device)

    def total(self, x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item())

    def reduce_(self, params: Sequence[torch.nn.Parameter]) -> None:
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            if p.grad is None:  # unused here but maybe not elsewhere: all must step alike
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            # One all-reduce per dtype rather than one per tensor (many small LoRA matrices).
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(summed)

    def broadcast_(self, params: Sequence[Tensor], src: int = 0) -> None:
        """Overwrite ``params`` with rank ``src``'s."""
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_loopback_address() -> str:
    """A ``tcp://127.0.0.1:port`` with a port free now, for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def local_rendezvous() -> str:
    """A ``file://`` rendezvous for workers that all run on this machine: a store file in a
    new temporary folder (``remove_rendezvous`` deletes it). Unlike a ``tcp://`` one it
    opens no port: rank 0's TCP store listens on every interface, whatever host the address
    names, while gloo's own connections stay on loopback (``GLOO_SOCKET_IFNAME``)."""
    return (Path(tempfile.mkdtemp(prefix="clew-rendezvous-")) / "store").as_uri()


def remove_rendezvous(init_method: str) -> None:
    """Delete the folder of a ``local_rendezvous`` store; other addresses are left alone."""
    parsed = urlparse(init_method)
    if parsed.scheme == "file":
        shutil.rmtree(Path(parsed.path).parent, ignore_errors=True)
