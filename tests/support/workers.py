"""Policy workers built alike, and their gradients compared, for the training-path tests."""

from __future__ import annotations

import torch

from clew.train import PolicyWorker, WorkerSettings


def make_worker(model_dir, device: str = "cpu", **settings) -> PolicyWorker:
    """A worker of ``model_dir`` with ``settings``, the same LoRA initialisation every time."""
    torch.manual_seed(0)
    return PolicyWorker.from_pretrained(model_dir, WorkerSettings(**settings), device=device)


def grads(worker: PolicyWorker) -> torch.Tensor:
    """Every gradient the worker's parameters hold, flattened into one vector."""
    return torch.cat([p.grad.flatten() for p in worker.model.parameters() if p.grad is not None])


def assert_same_gradient(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to float rounding, relative to the largest entry (which must not be 0)."""
    scale = want.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-4)
