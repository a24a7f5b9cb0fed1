"""Fixtures shared by test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tiny-model work on one torch thread.

    The tiny model gains little from a second thread, and on a shared 2-core machine two
    OpenMP threads competing with another process make each step up to 20x slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
