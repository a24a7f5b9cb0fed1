"""An adapter's files as the adapter store reads them: names, stamps and the cheap checks.

A name is one path segment of ``[A-Za-z0-9._-]`` starting with a letter or digit, so no name
can climb out of the prefix or be absolute. A stamp says which version of an adapter's files
was read (size and modification time or ETag of its config and weights), so that a loaded
adapter whose files were overwritten is noticed. ``check_header`` reads only a safetensors
file's header, so that the listing can leave out adapters that could never load without
reading their weights. ``lasting`` tells a failure of the files' content, which holds until
they change, from one of the storage, which is tried again after ``RECHECK_S``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from clew.errors import ClewError
from clew.serve.openai_errors import BadRequest, shorten

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
EXPORT_SUBDIR = "policy"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NAME_RULE = (
    "an adapter name is one folder name under the adapter prefix: letters, digits, '.', '_' "
    "and '-', starting with a letter or digit, at most 128 characters"
)


def check_name(name: str) -> str:
    """``name`` if it is a valid adapter name, else ``BadRequest`` saying what is accepted."""
    if not NAME_RE.fullmatch(name):
        raise BadRequest(
            f"{shorten(name)} is not a valid adapter name: {NAME_RULE}",
            param="model",
            code="invalid_adapter_name",
        )
    return name


Stamp = tuple[Any, ...]


@dataclass(frozen=True)
class AdapterFiles:
    """One adapter read into memory: its peft config and its LoRA tensors."""

    name: str
    source: str  # its folder relative to the prefix, e.g. ``best/policy``
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    stamp: Stamp = ()


RECHECK_S = 60.0  # an adapter that failed for its storage's sake is tried again this soon
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
MAX_HEADER_BYTES = 100 << 20


def check_header(fh: BinaryIO, size: int, max_bytes: int) -> None:
    """``ValueError`` unless ``fh`` (a file of ``size`` bytes) starts with a safetensors
    header of LoRA tensors (``lora_`` in each name, a float dtype) whose data fills the file
    to its end: a truncated or garbled file, or one still being written, fails here."""
    if size > max_bytes:
        raise ValueError(f"{size:,} bytes, over the server's limit of {max_bytes:,}")
    length = int.from_bytes(fh.read(8), "little")
    if not 2 <= length <= min(size - 8, MAX_HEADER_BYTES):
        raise ValueError("no safetensors header")
    header = json.loads(fh.read(length))
    if not isinstance(header, dict):
        raise ValueError("no safetensors header")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if not tensors or not all(isinstance(v, dict) for v in tensors.values()):
        raise ValueError("no tensors")
    odd = [k for k, v in tensors.items() if "lora_" not in k or v.get("dtype") not in FLOAT_DTYPES]
    if odd:
        raise ValueError(f"tensors that are not LoRA factors: {odd[:3]}")
    end = max(int((v.get("data_offsets") or [0, 0])[1]) for v in tensors.values())
    if 8 + length + end != size:
        raise ValueError(f"its tensors take {8 + length + end:,} bytes, the file {size:,}")


def lasting(error: BaseException) -> bool:
    """Whether ``error`` holds while the adapter's files stay as they are: their content is
    wrong (not LoRA, not safetensors, misfit to the base), rather than the storage failing
    to read them (an OS, network or storage error, which a retry may not meet)."""
    cause = error.__cause__
    if cause is None:  # one of the store's own checks of the files' content
        return True
    if isinstance(cause, OSError | ClewError):
        return False
    from safetensors import SafetensorError

    return isinstance(cause, ValueError | TypeError | LookupError | SafetensorError)
