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

What clients see: ``loadable`` lists only adapters whose files pass a cheap check (a LoRA
config, and safetensors weights whose header holds LoRA tensors that fill the file) and
that have not failed to load since their files last changed; ``/v1/models`` and the
playground list those. Each adapter's files carry a ``stamp`` (size and modification time
or ETag of its config and weights): a load records it, ``check`` re-reads it at most every
``check_ttl_s`` for a request, and an adapter whose files changed is fetched and loaded
again. Error messages name an adapter by its name and its files relative to the prefix;
the server's own paths stay in its log.

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
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from clew.checkpoint.storage import Storage, join
from clew.errors import ClewError
from clew.serve.adapter_files import (
    CONFIG_FILE,
    EXPORT_SUBDIR,
    NAME_RE,
    RECHECK_S,
    WEIGHTS_FILE,
    AdapterFiles,
    Stamp,
    check_header,
    check_name,
    lasting,
)
from clew.serve.openai_errors import AdapterUnavailable, ModelNotFound, ServeError, shorten

__all__ = ["AdapterFiles", "AdapterStore", "Stamp", "check_name"]

log = logging.getLogger(__name__)


class AdapterStore:
    """Lists, validates and fetches the adapters under one prefix (None: no adapters)."""

    def __init__(
        self,
        prefix: str | None,
        *,
        list_ttl_s: float = 5.0,
        check_ttl_s: float = 2.0,
        max_adapter_bytes: int = 4 << 30,
        fetch_threads: int = 2,
    ) -> None:
        self.prefix = prefix.rstrip("/") if prefix else None
        self.storage = Storage.for_path(self.prefix) if self.prefix else None
        self.list_ttl_s = list_ttl_s
        self.check_ttl_s = check_ttl_s
        self.max_adapter_bytes = max_adapter_bytes
        self._root = (
            os.path.realpath(self.prefix) if self.storage and self.storage.is_local else None
        )
        self._listed: tuple[float, list[str]] | None = None
        self._loadable: tuple[float, list[str]] | None = None
        self._checked: dict[str, tuple[float, Stamp]] = {}  # name: (when, its files' stamp)
        # Why a stamp of an adapter's files cannot load (None: it can), and until when that
        # holds (None: while the files stay as they are).
        self._verdicts: dict[str, tuple[Stamp, str | None, float | None]] = {}
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

    def loadable(self, *, refresh: bool = False) -> list[str]:
        """``names`` less the adapters whose files fail the check or failed to load (module
        docstring); read at most every ``list_ttl_s``."""
        cached = self._loadable
        now = time.monotonic()
        if cached and not refresh and now - cached[0] < self.list_ttl_s:
            return cached[1]
        names = [n for n in self.names(refresh=refresh) if self._verdict(n) is None]
        self._loadable = (now, names)
        return names

    def failed(self, name: str, stamp: Stamp, error: BaseException) -> None:
        """Record that ``name``'s files of ``stamp`` cannot be loaded, so that it is not
        listed: while the files stay as they are, or for ``RECHECK_S`` where the storage
        failed rather than the files (``lasting``)."""
        until = None if lasting(error) else time.monotonic() + RECHECK_S
        with self._lock:
            self._verdicts[name] = (stamp, str(error), until)
        self._loadable = None

    def _verdict(self, name: str) -> str | None:
        """Why ``name`` cannot be loaded, or None; checked once per stamp of its files."""
        try:
            sub, stamp = self._stamp(name)
        except (ClewError, OSError, ServeError) as exc:
            return str(exc)
        with self._lock:
            known = self._verdicts.get(name)
        if known is not None and known[0] == stamp and (known[2] or 1e300) > time.monotonic():
            return known[1]
        reason, until = None, None
        try:
            where = join(self.prefix or "", name, sub) if sub else join(self.prefix or "", name)
            self._read_config(name, join(where, CONFIG_FILE))
            self._check_header(name, join(where, WEIGHTS_FILE), stamp)
        except ServeError as exc:
            reason = exc.message
            until = None if lasting(exc) else time.monotonic() + RECHECK_S
        with self._lock:
            self._verdicts[name] = (stamp, reason, until)
        return reason

    # -- stamps ---------------------------------------------------------------------
    def check(self, name: str) -> Stamp:
        """The stamp of ``name``'s files, read at most every ``check_ttl_s``;
        ``ModelNotFound`` if it is not under the prefix."""
        now = time.monotonic()
        with self._lock:
            seen = self._checked.get(name)
        if seen is not None and now - seen[0] < self.check_ttl_s:
            return seen[1]
        _, stamp = self._stamp(name)
        with self._lock:
            self._checked[name] = (now, stamp)
        return stamp

    def latest(self, name: str) -> Stamp | None:
        """The stamp ``check`` last read for ``name`` (no storage call), or None."""
        with self._lock:
            seen = self._checked.get(name)
        return None if seen is None else seen[1]

    def _listing(self, name: str) -> tuple[str, Any, str]:
        """``name``'s folder under the prefix, the files in it, and where its config lies
        (``""`` or ``policy/``); ``ModelNotFound`` or ``AdapterUnavailable`` otherwise."""
        check_name(name)
        if self.storage is None or self.prefix is None:
            raise self._missing(name)
        folder = join(self.prefix, name)
        try:
            files = self.storage.list_files(folder)
        except (ClewError, OSError) as exc:
            log.warning("cannot list adapter %s at %s: %s", name, folder, exc)
            raise AdapterUnavailable(f"adapter {name!r} cannot be listed") from exc
        sub = "" if CONFIG_FILE in files else f"{EXPORT_SUBDIR}/"
        if f"{sub}{CONFIG_FILE}" not in files or not self._inside(f"{name}/{sub}{CONFIG_FILE}"):
            raise self._missing(name)
        return folder, files, sub

    def _stamp(self, name: str) -> tuple[str, Stamp]:
        """Where ``name``'s config lies (``""`` or ``policy/``) and its files' stamp: size
        and modification time (or ETag) of the config and the weights."""
        folder, files, sub = self._listing(name)
        parts: list[Any] = [sub]
        for file in (CONFIG_FILE, WEIGHTS_FILE):
            if f"{sub}{file}" not in files:
                parts.append(None)
                continue
            try:
                info = self.storage.fs.info(join(folder, f"{sub}{file}"))
            except OSError:
                parts.append(None)
                continue
            when = info.get("ETag") or info.get("LastModified") or info.get("mtime")
            parts.append((info.get("size"), str(when), info.get("ino")))
        return sub, tuple(parts)

    def _inside(self, rel: str) -> bool:
        """Whether a local file's real path stays under the prefix (always true on S3)."""
        if self._root is None:
            return True
        real = os.path.realpath(os.path.join(self._root, rel))
        return real.startswith(self._root + os.sep)

    # -- fetching -------------------------------------------------------------------
    def prepare(self, name: str) -> Future[AdapterFiles]:
        """A fetch of ``name``'s files, started now or already under way (one whose files
        have changed since is started again); ``discard`` it once loaded, so that a later
        load reads the storage afresh."""
        check_name(name)
        with self._lock:
            fut = self._pending.get(name)
            latest = self._checked.get(name)
            stale = (
                fut is not None
                and fut.done()
                and (
                    fut.exception() is not None
                    or (latest is not None and fut.result().stamp != latest[1])
                )
            )
            if fut is None or stale:
                fut = self._pool.submit(self._read_any, name)
                self._pending[name] = fut
            return fut

    def discard(self, name: str) -> None:
        with self._lock:
            self._pending.pop(name, None)

    def _read_any(self, name: str) -> AdapterFiles:
        """``read``, any failure of the storage it did not foresee made a 500 for this name;
        a failure is recorded (``failed``) against the files' stamp."""
        stamp: Stamp = ()
        try:
            _, stamp = self._stamp(name)
            with self._lock:
                self._checked[name] = (time.monotonic(), stamp)
            return self.read(name, stamp)
        except ModelNotFound:
            raise
        except ServeError as exc:
            self.failed(name, stamp, exc)
            raise
        except Exception as exc:
            log.exception("fetching adapter %s failed", name)
            message = f"adapter {name!r} cannot be fetched: {self.public(str(exc))}"
            error = AdapterUnavailable(message)
            error.__cause__ = exc
            self.failed(name, stamp, error)
            raise error from exc

    def read(self, name: str, stamp: Stamp = ()) -> AdapterFiles:
        """``name``'s config and tensors; ``ModelNotFound`` if it is not under the prefix,
        ``AdapterUnavailable`` if its files cannot be read as a LoRA adapter."""
        folder, files, sub = self._listing(name)
        where = join(folder, sub) if sub else folder
        source = f"{name}/{sub}".rstrip("/")
        weights = f"{sub}{WEIGHTS_FILE}"
        if weights not in files:
            raise AdapterUnavailable(
                f"adapter {name!r} ({source}) has {CONFIG_FILE} but no {WEIGHTS_FILE} (only "
                "safetensors weights are loaded)"
            )
        if not self._inside(f"{name}/{weights}"):
            raise AdapterUnavailable(
                f"adapter {name!r}: {source}/{WEIGHTS_FILE} links outside the adapter prefix"
            )
        if files[weights] > self.max_adapter_bytes:
            raise AdapterUnavailable(
                f"adapter {name!r}: {WEIGHTS_FILE} is {files[weights]:,} bytes, over the "
                f"server's limit of {self.max_adapter_bytes:,}"
            )
        config = self._read_config(name, join(where, CONFIG_FILE))
        tensors = self._read_weights(name, join(where, WEIGHTS_FILE))
        return AdapterFiles(name, source, config, tensors, stamp)

    def _missing(self, name: str) -> ModelNotFound:
        if self.prefix is None:
            why = "the server was started without an adapter prefix (--adapters)"
        else:
            why = f"no folder holding {CONFIG_FILE} of that name under the adapter prefix"
        return ModelNotFound(f"no adapter {shorten(name)}: {why}", param="model")

    def public(self, text: str) -> str:
        """``text``'s first line with the server's own paths (the prefix) left out, for a
        client."""
        text = (text.splitlines() or [""])[0]
        for path in sorted({self.prefix or "", self._root or ""}, key=len, reverse=True):
            if path:
                text = text.replace(path, "<adapters>")
        return text

    def _relative(self, path: str) -> str:
        """A file's path under the prefix, as an error message names it."""
        prefix = (self.prefix or "") + "/"
        return path[len(prefix) :] if path.startswith(prefix) else self.public(path)

    def _read_config(self, name: str, path: str) -> dict[str, Any]:
        assert self.storage is not None
        try:
            config = json.loads(self.storage.read_text(path))
        except (ClewError, OSError, ValueError) as exc:
            log.warning("adapter %s: cannot read %s: %s", name, path, exc)
            raise AdapterUnavailable(
                f"adapter {name!r}: cannot read {self._relative(path)} "
                f"({type(exc).__name__}: {self.public(str(exc))})"
            ) from exc
        if not isinstance(config, dict) or config.get("peft_type") != "LORA":
            raise AdapterUnavailable(
                f"adapter {name!r}: {self._relative(path)} is not a LoRA adapter config "
                "(peft_type must be 'LORA', got "
                f"{config.get('peft_type') if isinstance(config, dict) else config!r})"
            )
        return config

    def _check_header(self, name: str, path: str, stamp: Stamp) -> None:
        """The weights' safetensors header is one of LoRA tensors (``check_header``)."""
        assert self.storage is not None
        size = stamp[2][0] if len(stamp) > 2 and stamp[2] else None
        if size is None:
            raise AdapterUnavailable(f"adapter {name!r} has no {WEIGHTS_FILE}")
        try:
            with self.storage.fs.open(path, "rb") as fh:
                check_header(fh, size, self.max_adapter_bytes)
        except (OSError, ValueError, TypeError, LookupError) as exc:
            raise AdapterUnavailable(
                f"adapter {name!r}: {self._relative(path)} is not a safetensors file of LoRA "
                f"weights ({self.public(str(exc))})"
            ) from exc

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
            log.warning("adapter %s: cannot read %s: %s", name, path, exc)
            raise AdapterUnavailable(
                f"adapter {name!r}: cannot read {self._relative(path)} "
                f"({type(exc).__name__}: {self.public(str(exc))})"
            ) from exc
        bad = [k for k, t in tensors.items() if "lora_" not in k or not t.is_floating_point()]
        if not tensors or bad:
            raise AdapterUnavailable(
                f"adapter {name!r}: {self._relative(path)} holds no LoRA weights"
                + (f" (unexpected tensors: {bad[:3]})" if bad else "")
            )
        return tensors
