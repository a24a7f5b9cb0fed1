"""Where checkpoints live: one small file-system interface over local disk and S3.

Training jobs save to a local path on a single box and to ``s3://bucket/prefix`` (or an
S3-compatible store) on a cluster. fsspec already speaks both, so ``Storage`` is a thin layer
that adds what a checkpoint needs on top of it:

* **Retries.** Each file operation is retried on transient errors with exponential backoff
  (``retry.py`` says which errors and why).
* **Clear errors.** A missing bucket or an unwritable directory becomes a ``CheckpointError``
  that names the path and says what to do, instead of a botocore traceback.
* **Explicit per-file copies.** ``put_dir``/``get_dir`` walk the tree and copy file by file
  rather than calling fsspec's recursive ``put``/``get``: those copy *into* or *as* the
  target depending on trailing slashes and on whether the target exists, and a per-file loop
  lets each file be retried on its own.
* **Local atomicity.** Local writes of small files go to a temporary name then
  ``os.replace``, and data files are fsynced, so a crash never leaves a half-written pointer.

Credentials are found the standard AWS way (env vars, ``~/.aws``, instance roles) by botocore.
The endpoint of an S3-compatible store comes from ``endpoint_url=``, else
``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``; it is resolved here and passed to s3fs
explicitly so the precedence does not depend on the installed botocore's env support.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from clew.checkpoint.retry import RetryPolicy, is_missing_bucket, is_transient
from clew.errors import CheckpointError

log = logging.getLogger(__name__)
T = TypeVar("T")

_CHUNK = 8 * 1024 * 1024


def join(base: str, *parts: str) -> str:
    """Join path parts with '/', for both local paths and URLs."""
    out = base.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def resolve_endpoint(endpoint_url: str | None = None) -> str | None:
    """The S3 endpoint: explicit argument, else AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL."""
    return (
        endpoint_url
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or None
    )


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Storage:
    """File operations on one file system (local or S3), with retries and clear errors.

    Paths are given whole: ``/data/ckpt/...`` or ``s3://bucket/prefix/...``. Build one with
    ``Storage.for_path(ckpt_path)``, or ``Storage(fs)`` around any fsspec file system.
    """

    def __init__(self, fs: Any, *, protocol: str = "file", retry: RetryPolicy | None = None):
        self.fs = fs
        self.protocol = protocol
        self.retry = retry or RetryPolicy()
        self.is_local = isinstance(fs, LocalFileSystem)

    @classmethod
    def for_path(
        cls,
        path: str,
        *,
        endpoint_url: str | None = None,
        retry: RetryPolicy | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> Storage:
        """The storage for ``path``: local for plain paths, s3fs for ``s3://``."""
        protocol = path.split("://", 1)[0] if "://" in path else "file"
        opts = dict(storage_options or {})
        if protocol == "file":
            return cls(LocalFileSystem(), protocol="file", retry=retry)
        if protocol in ("s3", "s3a"):
            try:
                import s3fs
            except ImportError as exc:
                raise CheckpointError(
                    f"{path}: s3:// checkpoints need s3fs; install it with `pip install 'clew[s3]'`"
                ) from exc
            client_kwargs = dict(opts.pop("client_kwargs", {}))
            endpoint = endpoint_url or client_kwargs.get("endpoint_url") or resolve_endpoint()
            if endpoint:
                client_kwargs["endpoint_url"] = endpoint
            # Fresh instance, no listing cache: resume/prune must see what other
            # processes wrote, not what this one listed earlier.
            fs = s3fs.S3FileSystem(
                client_kwargs=client_kwargs,
                skip_instance_cache=True,
                use_listings_cache=False,
                **opts,
            )
            return cls(fs, protocol="s3", retry=retry)
        try:
            fs = fsspec.filesystem(protocol, **opts)
        except (ImportError, ValueError) as exc:
            raise CheckpointError(
                f"{path}: unsupported storage protocol {protocol!r} ({exc}); "
                "use a local path or s3://bucket/prefix"
            ) from exc
        return cls(fs, protocol=protocol, retry=retry)

    # -- helpers ---------------------------------------------------------------------

    def _p(self, path: str) -> str:
        if "://" in path:
            proto = path.split("://", 1)[0]
            if proto != self.protocol and not (self.protocol == "s3" and proto == "s3a"):
                raise CheckpointError(f"{path}: this storage handles {self.protocol}:// paths")
            path = path.split("://", 1)[1] if self.is_local else path
        # Local paths are made absolute so they match the names fsspec lists back.
        return os.path.abspath(path) if self.is_local else self.fs._strip_protocol(path)

    def _bucket(self, path: str) -> str:
        return self._p(path).split("/", 1)[0]

    def _user_error(self, exc: BaseException, path: str, action: str) -> CheckpointError | None:
        """A CheckpointError for failures the user must fix, else None."""
        if is_missing_bucket(exc):
            bucket = self._bucket(path)
            return CheckpointError(
                f"cannot {action} {path}: S3 bucket {bucket!r} does not exist. Create it "
                f"(e.g. `aws s3 mb s3://{bucket}`) or fix the checkpoint path; for an "
                "S3-compatible store check endpoint_url / AWS_ENDPOINT_URL"
            )
        if isinstance(exc, PermissionError):
            hint = (
                "check the AWS credentials and the bucket policy"
                if not self.is_local
                else "choose a writable directory or fix its permissions"
            )
            return CheckpointError(f"cannot {action} {path}: permission denied; {hint}")
        if self.is_local and isinstance(exc, NotADirectoryError | FileExistsError):
            return CheckpointError(
                f"cannot {action} {path}: a parent of this path is a file, not a directory; "
                "choose another checkpoint path"
            )
        if self.is_local and isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.ENOSPC):
            return CheckpointError(
                f"cannot {action} {path}: {os.strerror(exc.errno)}; choose another checkpoint path"
            )
        return None

    def _call(self, action: str, path: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transient errors; turn user errors into CheckpointError."""
        attempts = max(1, self.retry.attempts)
        for attempt in range(1, attempts + 1):
            try:
                return fn()
            except Exception as exc:
                user = self._user_error(exc, path, action)
                if user is not None:
                    raise user from exc
                if not is_transient(exc):
                    raise
                if attempt == attempts:
                    raise CheckpointError(
                        f"cannot {action} {path}: gave up after {attempts} attempts "
                        f"(last error: {type(exc).__name__}: {exc}); check the network"
                        + ("" if self.is_local else ", endpoint_url and AWS_ENDPOINT_URL")
                    ) from exc
                delay = self.retry.delay(attempt)
                log.warning(
                    "%s %s failed (%s: %s); retry %d/%d in %.1fs",
                    action,
                    path,
                    type(exc).__name__,
                    exc,
                    attempt,
                    attempts - 1,
                    delay,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _local_parent(self, path: str) -> None:
        if self.is_local:
            parent = os.path.dirname(self._p(path))
            if parent:
                os.makedirs(parent, exist_ok=True)

    # -- writes ----------------------------------------------------------------------

    def ensure_root(self, path: str) -> None:
        """Make ``path`` usable as a write target: create it locally, check the bucket on S3."""
        if self.is_local:
            self._call("create", path, lambda: os.makedirs(self._p(path), exist_ok=True))
        elif self.protocol == "s3":
            self.check_bucket(path)

    def check_bucket(self, path: str) -> None:
        """Raise CheckpointError if the bucket of an s3:// path does not exist."""
        if self.protocol != "s3":
            return
        bucket = self._bucket(path)

        def head() -> bool:
            # Not fs.exists(): it answers False for any failure, network blips included,
            # which would then be reported as a missing bucket instead of retried.
            try:
                self.fs.call_s3("head_bucket", Bucket=bucket)
            except FileNotFoundError:
                return False
            except PermissionError:
                pass  # it exists; HeadBucket is denied, so later writes will say what is
            return True

        if not self._call("check", path, head):
            raise CheckpointError(
                f"{path}: S3 bucket {bucket!r} does not exist. Create it (e.g. `aws s3 mb s3://{bucket}`) or fix the "
                "checkpoint path; for an S3-compatible store check endpoint_url / "
                "AWS_ENDPOINT_URL"
            )

    def put_file(self, local: str | Path, remote: str) -> None:
        """Copy one local file to ``remote`` (overwriting it)."""
        local = str(local)

        def put() -> None:
            self._local_parent(remote)
            self.fs.put_file(local, self._p(remote))
            if self.is_local:
                _fsync_path(self._p(remote))

        self._call("write", remote, put)

    def put_dir(self, local_dir: str | Path, remote_dir: str) -> list[str]:
        """Copy every file under ``local_dir`` to the same relative path under ``remote_dir``.

        Returns the relative paths copied, in upload order (sorted, so reruns are stable).
        """
        rels = local_files(local_dir)
        for rel in rels:
            self.put_file(os.path.join(str(local_dir), rel), join(remote_dir, rel))
        return rels

    def write_text(self, path: str, text: str) -> None:
        """Write a small text file in one step: tmp + os.replace locally, one PUT on S3."""
        data = text.encode()

        def write() -> None:
            target = self._p(path)
            if not self.is_local:
                self.fs.pipe_file(target, data)
                return
            self._local_parent(path)
            tmp = f"{target}.tmp-{uuid.uuid4().hex}"
            try:
                with open(tmp, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            _fsync_path(os.path.dirname(target) or ".", directory=True)

        self._call("write", path, write)

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomically rename a local directory (not available on object stores)."""
        if not self.is_local:
            raise NotImplementedError("object stores have no atomic directory rename")

        def rename() -> None:
            os.replace(self._p(src), self._p(dst))
            _fsync_path(os.path.dirname(self._p(dst)) or ".", directory=True)

        self._call("rename", src, rename)

    def rm_tree(self, path: str) -> None:
        """Delete ``path`` and everything under it; a missing path is not an error."""

        def rm() -> None:
            if self.fs.exists(self._p(path)):
                self.fs.rm(self._p(path), recursive=True)

        self._call("delete", path, rm)

    # -- reads -----------------------------------------------------------------------

    def exists(self, path: str) -> bool:
        return self._call("check", path, lambda: bool(self.fs.exists(self._p(path))))

    def read_text(self, path: str) -> str:
        """The text of a file; FileNotFoundError if it is missing."""
        return self._call("read", path, lambda: self.fs.cat_file(self._p(path)).decode())

    def list_dirs(self, prefix: str) -> list[str]:
        """Names (not paths) of the directories directly under ``prefix``; [] if missing."""

        def ls() -> list[str]:
            try:
                entries = self.fs.ls(self._p(prefix), detail=True)
            except FileNotFoundError as exc:
                if is_missing_bucket(exc):
                    raise
                return []
            return sorted(
                e["name"].rstrip("/").rsplit("/", 1)[-1]
                for e in entries
                if e.get("type") == "directory"
            )

        return self._call("list", prefix, ls)

    def list_files(self, prefix: str) -> dict[str, int]:
        """Every file under ``prefix`` as {relative path: size}; {} if missing."""
        root = self._p(prefix).rstrip("/")

        def find() -> dict[str, int]:
            try:
                found = self.fs.find(root, detail=True)
            except FileNotFoundError as exc:
                if is_missing_bucket(exc):
                    raise
                return {}
            return {
                name[len(root) + 1 :]: int(info.get("size") or 0)
                for name, info in found.items()
                if info.get("type") != "directory" and name.startswith(root + "/")
            }

        return self._call("list", prefix, find)

    def sha256(self, path: str) -> str:
        """Hex sha256 of a file, streamed in chunks."""

        def digest() -> str:
            h = hashlib.sha256()
            with self.fs.open(self._p(path), "rb") as fh:
                while chunk := fh.read(_CHUNK):
                    h.update(chunk)
            return h.hexdigest()

        return self._call("read", path, digest)

    def get_file(self, remote: str, local: str | Path) -> None:
        """Copy one file from storage to a local path (parents created)."""
        local = str(local)

        def get() -> None:
            os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
            self.fs.get_file(self._p(remote), local)

        self._call("read", remote, get)

    def get_dir(self, remote_dir: str, local_dir: str | Path) -> list[str]:
        """Copy every file under ``remote_dir`` into ``local_dir``; returns relative paths."""
        rels = sorted(self.list_files(remote_dir))
        for rel in rels:
            self.get_file(join(remote_dir, rel), os.path.join(str(local_dir), rel))
        return rels


def local_files(local_dir: str | Path) -> list[str]:
    """Relative POSIX paths of all files under ``local_dir``, sorted."""
    root = Path(local_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory (expected the checkpoint's files)")
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def local_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
