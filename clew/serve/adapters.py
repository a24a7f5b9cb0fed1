"""The adapter store: LoRA adapters under a storage prefix, loaded on first use, LRU-held.

Layout: ``PREFIX/NAME/`` holds a PEFT adapter as clew exports it (``adapter_config.json`` and
``adapter_model.safetensors``, processor files beside them ignored), or ``PREFIX/NAME/policy/``
does, so a run's export folder (``final/policy``, ``best/policy``,
``global_step_N/policy``) serves as a prefix as it is. ``PREFIX`` is a local directory or an
``s3://`` URL (``clew.checkpoint.storage``: an S3-compatible endpoint from
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``).

Two halves, on two sides of the scheduler:

* ``AdapterStore`` reads: it lists the prefix, validates names and fetches an adapter's
  files into memory on a small thread pool (``prepare``: one fetch per name however many
  requests wait for it), so a slow download never stalls the decode steps of other requests.
  Names are one path segment of ``[A-Za-z0-9._-]`` starting with a letter or digit, so no
  name can climb out of the prefix or be absolute; on a local prefix, files whose real path
  (symlinks resolved) leaves the prefix are refused too. Only safetensors weights are read:
  a pickled ``adapter_model.bin`` could run code when loaded.
* ``LoadedAdapters`` (``clew.serve.adapter_pool``) holds at most ``capacity`` adapters in
  the engine (``InferenceEngine.add_adapter``), least recently used evicted, and is touched
  by the scheduler's thread only.

Why adapters are held as LoRA factors beside one plain base, not as merged copies: a merged
copy holds a whole model per adapter (for an 8B policy in bfloat16, 16 GB each), a LoRA
adapter only its low-rank factors (rank 32 on every language-model projection of an 8B
Qwen: about 0.1 B parameters by arithmetic, a few hundred MB), so ``--max-adapters`` can be
large on the GPU that holds the base once. And since each row of an engine batch names its
own adapter (``clew.inference.multi_lora``), requests for the base and for different
adapters run in one forward; the cost is the per-row low-rank update in every projection.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clew.checkpoint.storage import Storage, join
from clew.errors import ClewError
from clew.serve.errors import AdapterUnavailable, BadRequest, ModelNotFound, ServeError

log = logging.getLogger(__name__)

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
            f"{name!r} is not a valid adapter name: {NAME_RULE}",
            param="model",
            code="invalid_adapter_name",
        )
    return name


@dataclass(frozen=True)
class AdapterFiles:
    """One adapter read into memory: its peft config and its LoRA tensors."""

    name: str
    source: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]


class AdapterStore:
    """Lists, validates and fetches the adapters under one prefix (None: no adapters)."""

    def __init__(
        self,
        prefix: str | None,
        *,
        list_ttl_s: float = 5.0,
        max_adapter_bytes: int = 4 << 30,
        fetch_threads: int = 2,
    ) -> None:
        self.prefix = prefix.rstrip("/") if prefix else None
        self.storage = Storage.for_path(self.prefix) if self.prefix else None
        self.list_ttl_s = list_ttl_s
        self.max_adapter_bytes = max_adapter_bytes
        self._root = (
            os.path.realpath(self.prefix) if self.storage and self.storage.is_local else None
        )
        self._listed: tuple[float, list[str]] | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, Future[AdapterFiles]] = {}
        self._pool = ThreadPoolExecutor(fetch_threads, thread_name_prefix="clew-adapter-fetch")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- listing --------------------------------------------------------------------
    def names(self, *, refresh: bool = False) -> list[str]:
        """The adapters under the prefix, sorted (listed at most every ``list_ttl_s``)."""
        if self.storage is None or self.prefix is None:
            return []
        now = time.monotonic()
        cached = self._listed
        if cached and not refresh and now - cached[0] < self.list_ttl_s:
            return cached[1]
        try:
            files = self.storage.list_files(self.prefix)
        except (ClewError, OSError) as exc:
            log.warning("cannot list the adapters under %s: %s", self.prefix, exc)
            return cached[1] if cached else []
        found = set()
        for rel in files:
            parts = rel.split("/")
            layout = parts[1:] in ([CONFIG_FILE], [EXPORT_SUBDIR, CONFIG_FILE])
            if layout and NAME_RE.fullmatch(parts[0]) and self._inside(rel):
                found.add(parts[0])
        names = sorted(found)
        self._listed = (now, names)
        return names

    def _inside(self, rel: str) -> bool:
        """Whether a local file's real path stays under the prefix (always true on S3)."""
        if self._root is None:
            return True
        real = os.path.realpath(os.path.join(self._root, rel))
        return real.startswith(self._root + os.sep)

    # -- fetching -------------------------------------------------------------------
    def prepare(self, name: str) -> Future[AdapterFiles]:
        """A fetch of ``name``'s files, started now or already under way; ``discard`` it
        once loaded, so that a later load reads the storage afresh."""
        check_name(name)
        with self._lock:
            fut = self._pending.get(name)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._pool.submit(self._read_any, name)
                self._pending[name] = fut
            return fut

    def discard(self, name: str) -> None:
        with self._lock:
            self._pending.pop(name, None)

    def _read_any(self, name: str) -> AdapterFiles:
        """``read``, any failure of the storage it did not foresee made a 500 for this name."""
        try:
            return self.read(name)
        except ServeError:
            raise
        except Exception as exc:
            log.exception("fetching adapter %s failed", name)
            raise AdapterUnavailable(f"adapter {name!r} cannot be fetched: {exc}") from exc

    def read(self, name: str) -> AdapterFiles:
        """``name``'s config and tensors; ``ModelNotFound`` if it is not under the prefix,
        ``AdapterUnavailable`` if its files cannot be read as a LoRA adapter."""
        check_name(name)
        if self.storage is None or self.prefix is None:
            raise ModelNotFound(
                f"no adapter {name!r}: the server was started without an adapter prefix "
                "(--adapters)",
                param="model",
            )
        folder = join(self.prefix, name)
        try:
            files = self.storage.list_files(folder)
        except (ClewError, OSError) as exc:
            raise AdapterUnavailable(f"cannot list adapter {name!r} at {folder}: {exc}") from exc
        sub = "" if CONFIG_FILE in files else f"{EXPORT_SUBDIR}/"
        if f"{sub}{CONFIG_FILE}" not in files or not self._inside(f"{name}/{sub}{CONFIG_FILE}"):
            raise ModelNotFound(self.not_found_message(name), param="model")
        where = join(folder, sub) if sub else folder
        weights = f"{sub}{WEIGHTS_FILE}"
        if weights not in files:
            raise AdapterUnavailable(
                f"adapter {name!r} at {where} has {CONFIG_FILE} but no {WEIGHTS_FILE} (only "
                "safetensors weights are loaded)"
            )
        if not self._inside(f"{name}/{weights}"):
            raise AdapterUnavailable(f"adapter {name!r}: {weights} links outside {self.prefix}")
        if files[weights] > self.max_adapter_bytes:
            raise AdapterUnavailable(
                f"adapter {name!r}: {WEIGHTS_FILE} is {files[weights]:,} bytes, over the "
                f"server's limit of {self.max_adapter_bytes:,}"
            )
        config = self._read_config(name, join(where, CONFIG_FILE))
        tensors = self._read_weights(name, join(where, WEIGHTS_FILE))
        return AdapterFiles(name, where, config, tensors)

    def not_found_message(self, name: str) -> str:
        names = self.names(refresh=True)
        listed = ", ".join(names[:50]) + (" ..." if len(names) > 50 else "")
        return (
            f"no adapter {name!r} under {self.prefix} (a folder holding {CONFIG_FILE}); "
            f"available adapters: {listed or 'none'}"
        )

    def _read_config(self, name: str, path: str) -> dict[str, Any]:
        assert self.storage is not None
        try:
            config = json.loads(self.storage.read_text(path))
        except (ClewError, OSError, ValueError) as exc:
            raise AdapterUnavailable(f"adapter {name!r}: cannot read {path}: {exc}") from exc
        if not isinstance(config, dict) or config.get("peft_type") != "LORA":
            raise AdapterUnavailable(
                f"adapter {name!r}: {path} is not a LoRA adapter config (peft_type must be "
                f"'LORA', got {config.get('peft_type') if isinstance(config, dict) else config!r})"
            )
        return config

    def _read_weights(self, name: str, path: str) -> dict[str, torch.Tensor]:
        from safetensors import SafetensorError
        from safetensors.torch import load, load_file

        assert self.storage is not None
        try:
            if self.storage.is_local:
                tensors = load_file(path)
            else:
                with tempfile.TemporaryDirectory(prefix="clew-adapter-") as tmp:
                    local = Path(tmp) / WEIGHTS_FILE
                    self.storage.get_file(path, local)
                    tensors = load(local.read_bytes())
        except (ClewError, OSError, SafetensorError, ValueError, RuntimeError) as exc:
            raise AdapterUnavailable(f"adapter {name!r}: cannot read {path}: {exc}") from exc
        bad = [k for k, t in tensors.items() if "lora_" not in k or not t.is_floating_point()]
        if not tensors or bad:
            raise AdapterUnavailable(
                f"adapter {name!r}: {path} holds no LoRA weights"
                + (f" (unexpected tensors: {bad[:3]})" if bad else "")
            )
        return tensors
