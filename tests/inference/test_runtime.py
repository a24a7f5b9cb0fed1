"""Process-wide settings a clew command applies before it drives a device."""

from __future__ import annotations

import pytest
import torch

from clew.inference.runtime import (
    ACCELERATOR_HOST_THREADS,
    limit_device_memory,
    limit_host_threads,
)


@pytest.fixture
def eight_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    yield
    torch.set_num_threads(before)


def test_an_accelerator_process_caps_torch_host_threads(eight_threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    limit_host_threads(torch.device("cpu"))
    assert torch.get_num_threads() == 8  # the CPU does its work on these threads
    limit_host_threads(torch.device("cuda", 0))
    assert torch.get_num_threads() == ACCELERATOR_HOST_THREADS < 8


def test_an_explicit_omp_num_threads_is_left_alone(eight_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    limit_host_threads(torch.device("cuda", 0))
    assert torch.get_num_threads() == 8


def test_a_memory_share_leaves_a_cpu_process_alone() -> None:
    limit_device_memory(torch.device("cpu"), 0.25)  # nothing to cap; must not touch CUDA


@pytest.mark.gpu
def test_a_memory_share_caps_what_the_process_may_allocate_on_the_gpu() -> None:
    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    # 1% of the card beyond what earlier tests of this process still hold.
    limit_device_memory(device, (torch.cuda.memory_allocated(device) + total * 0.01) / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(total * 0.02), dtype=torch.uint8, device=device)
        small = torch.empty(int(total * 0.005), dtype=torch.uint8, device=device)
        del small
    finally:
        limit_device_memory(device, 1.0)
        torch.cuda.empty_cache()
    big = torch.empty(int(total * 0.02), dtype=torch.uint8, device=device)
    del big
