"""Loading clew's Triton kernels compiled, or for Triton's interpreter (on a CPU, in tests).

Triton decides when it jits a function whether it is interpreted (``TRITON_INTERPRET``), so
an interpreted copy of a kernel and its compiled copy cannot be the same objects: each
kernel file is loaded as a module of its own per mode (``kernels``), and launches of the
interpreted copy run inside ``interpreter(True)``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType


@contextlib.contextmanager
def interpreter(on: bool) -> Iterator[None]:
    """``TRITON_INTERPRET=1`` within the block if ``on`` (Triton reads it when it jits a
    kernel and again when it launches one); the environment as it is otherwise."""
    if not on:
        yield
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


@functools.cache
def kernels(stem: str, interpret: bool) -> ModuleType:
    """The module ``clew/kernels/<stem>.py``, loaded on first use for ``interpret``."""
    name = f"clew.kernels.{stem}" + ("_interpreted" if interpret else "")
    path = Path(__file__).with_name(f"{stem}.py")
    with interpreter(interpret):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # Triton reads a kernel's globals through its module
        spec.loader.exec_module(module)
    return module
