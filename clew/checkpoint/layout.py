"""Checkpoint layout and commit protocol, compatible with SkyRL's directory layout.

::

    ckpt_path/
      latest_ckpt_global_step.txt     # "N": the last fully committed step, written LAST
      global_step_N/
        manifest.json                 # every file's relative path, size and sha256
        ...                           # whatever the trainer staged

A crash can happen at any point of a save, and resume must never pick up half a checkpoint.
So a step is *complete* only when its ``manifest.json`` exists and every file matches it, and
the pointer moves only after the step is complete:

* local disk: files are copied into ``global_step_N.tmp-<uuid>``, the manifest is written
  inside it, and the directory is renamed into place (atomic on one file system);
* S3 (no rename): files are uploaded under ``global_step_N/`` and the manifest is uploaded
  last, so a step without a manifest is a half-written upload and is never chosen;
* then the pointer is written in one step (tmp + ``os.replace`` locally, one PUT on S3).

``find_resume_step`` trusts the pointer only after verifying the step it names, and falls back
to the newest complete step otherwise, saying what it skipped and why.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from clew.checkpoint.storage import Storage, join, local_files, local_sha256
from clew.errors import CheckpointError

POINTER_FILE = "latest_ckpt_global_step.txt"
MANIFEST_FILE = "manifest.json"
STEP_PREFIX = "global_step_"
MANIFEST_FORMAT = "clew-checkpoint/1"
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")
_TMP_MARK = ".tmp-"


def step_dir(ckpt_path: str, step: int) -> str:
    """``ckpt_path/global_step_<step>``."""
    return join(ckpt_path, f"{STEP_PREFIX}{step}")


def parse_step(name: str) -> int | None:
    """The step of a ``global_step_N`` directory name; None for anything else (tmp dirs)."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def build_manifest(local_dir: str | Path, step: int) -> dict[str, Any]:
    """Describe every file under ``local_dir`` (except a manifest) by path, size and sha256."""
    files = []
    for rel in local_files(local_dir):
        if rel == MANIFEST_FILE:
            continue
        path = Path(local_dir) / rel
        files.append({"path": rel, "size": path.stat().st_size, "sha256": local_sha256(path)})
    return {"format": MANIFEST_FORMAT, "step": step, "created_unix": time.time(), "files": files}


def parse_manifest(text: str) -> list[dict[str, Any]]:
    """The file entries of a manifest; ValueError if it is malformed or unsafe."""
    data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise ValueError("manifest has no 'files' list")
    for entry in data["files"]:
        rel = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/"):
            raise ValueError(f"manifest has an invalid file path: {rel!r}")
        if not isinstance(entry.get("size"), int) or not isinstance(entry.get("sha256"), str):
            raise ValueError(f"manifest entry for {rel} lacks an int size or a sha256")
    return data["files"]


def commit_checkpoint(
    storage: Storage, ckpt_path: str, step: int, local_staging_dir: str | Path
) -> str:
    """Publish the files staged in ``local_staging_dir`` as step ``step``; return its dir.

    If anything fails before the pointer is written, the exception propagates and the
    pointer still names the previous step.
    """
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint step must be a non-negative int, got {step!r}")
    storage.ensure_root(ckpt_path)
    manifest = build_manifest(local_staging_dir, step)
    manifest_text = json.dumps(manifest, indent=1)
    final = step_dir(ckpt_path, step)
    if storage.is_local:
        _commit_local(storage, ckpt_path, step, local_staging_dir, manifest, manifest_text)
    else:
        if storage.exists(final):
            # Re-saving a step: un-complete it first (manifest gone), then clear stale files.
            storage.rm_tree(join(final, MANIFEST_FILE))
            storage.rm_tree(final)
        for entry in manifest["files"]:
            storage.put_file(Path(local_staging_dir) / entry["path"], join(final, entry["path"]))
        storage.write_text(join(final, MANIFEST_FILE), manifest_text)
    storage.write_text(join(ckpt_path, POINTER_FILE), f"{step}\n")
    return final


def _commit_local(
    storage: Storage,
    ckpt_path: str,
    step: int,
    staging: str | Path,
    manifest: dict[str, Any],
    manifest_text: str,
) -> None:
    final = step_dir(ckpt_path, step)
    tmp = join(ckpt_path, f"{STEP_PREFIX}{step}{_TMP_MARK}{uuid.uuid4().hex}")
    try:
        for entry in manifest["files"]:
            storage.put_file(Path(staging) / entry["path"], join(tmp, entry["path"]))
        storage.write_text(join(tmp, MANIFEST_FILE), manifest_text)
        if storage.exists(final):
            # A directory cannot be renamed onto a non-empty one: move the old copy aside
            # under a tmp name (prune removes it if we die before deleting it).
            old = f"{tmp}-old"
            storage.rename_dir(final, old)
            try:
                storage.rename_dir(tmp, final)
            except BaseException:
                storage.rename_dir(old, final)
                raise
            storage.rm_tree(old)
        else:
            storage.rename_dir(tmp, final)
    finally:
        if storage.exists(tmp):
            storage.rm_tree(tmp)


def _read_manifest(storage: Storage, sdir: str) -> tuple[list[dict[str, Any]] | None, str]:
    """(entries, "") or (None, why the step is not complete)."""
    try:
        text = storage.read_text(join(sdir, MANIFEST_FILE))
    except FileNotFoundError:
        if not storage.exists(sdir):
            return None, f"{sdir}: directory does not exist"
        return None, f"{sdir}: missing {MANIFEST_FILE} (incomplete or half-written save)"
    try:
        return parse_manifest(text), ""
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        return None, f"{sdir}: unreadable {MANIFEST_FILE}: {exc}"


def verify_checkpoint(storage: Storage, step_dir: str, *, checksums: bool = True) -> list[str]:
    """Problems that make ``step_dir`` unusable; empty when it is complete.

    ``checksums=False`` checks presence and sizes only (cheap on S3, where hashing means
    reading every byte); ``download_checkpoint`` always checks the hashes of what it fetched.
    """
    entries, why = _read_manifest(storage, step_dir)
    if entries is None:
        return [why]
    found = storage.list_files(step_dir)
    problems = []
    for entry in entries:
        rel, size = entry["path"], entry["size"]
        if rel not in found:
            problems.append(f"{step_dir}: missing file {rel}")
        elif found[rel] != size:
            problems.append(
                f"{step_dir}: size mismatch for {rel}: manifest says {size} "
                f"bytes, found {found[rel]}"
            )
        elif checksums and storage.sha256(join(step_dir, rel)) != entry["sha256"]:
            problems.append(f"{step_dir}: checksum mismatch for {rel} (sha256 differs)")
    return problems


def list_steps(storage: Storage, ckpt_path: str) -> list[int]:
    """Steps that have a ``global_step_N`` directory (complete or not), ascending."""
    steps = (parse_step(name) for name in storage.list_dirs(ckpt_path))
    return sorted(s for s in steps if s is not None)


def read_pointer(storage: Storage, ckpt_path: str) -> int | None:
    """The step named by the pointer file; None if it is missing.

    Raises ValueError if the file holds something other than a step number.
    """
    try:
        text = storage.read_text(join(ckpt_path, POINTER_FILE))
    except FileNotFoundError:
        return None
    value = text.strip()
    if not value.isdigit():
        raise ValueError(f"{join(ckpt_path, POINTER_FILE)} holds {value[:40]!r}, not a step")
    return int(value)


def find_resume_step(
    storage: Storage, ckpt_path: str, *, checksums: bool = True
) -> tuple[int | None, list[str]]:
    """The step to resume from and warnings about what was skipped and why.

    The pointer's step if it verifies; else the newest complete step. (None, []) when the
    path holds no checkpoints at all.
    """
    storage.check_bucket(ckpt_path)
    warnings: list[str] = []
    pointer_file = join(ckpt_path, POINTER_FILE)
    try:
        pointer = read_pointer(storage, ckpt_path)
    except ValueError as exc:
        pointer = None
        warnings.append(f"ignoring {pointer_file}: {exc}")
    if pointer is not None:
        problems = verify_checkpoint(storage, step_dir(ckpt_path, pointer), checksums=checksums)
        if not problems:
            return pointer, warnings
        warnings.append(f"skipped step {pointer} named by {pointer_file}: " + "; ".join(problems))
    steps = [s for s in reversed(list_steps(storage, ckpt_path)) if s != pointer]
    if pointer is None and not warnings and steps:
        warnings.append(f"no {pointer_file}; looking for the newest complete step")
    for step in steps:
        problems = verify_checkpoint(storage, step_dir(ckpt_path, step), checksums=checksums)
        if not problems:
            warnings.append(f"resuming from step {step}, the newest complete one")
            return step, warnings
        warnings.append(f"skipped step {step}: " + "; ".join(problems))
    if warnings:
        warnings.append(f"no complete checkpoint under {ckpt_path}; starting from scratch")
    return None, warnings


def prune_checkpoints(storage: Storage, ckpt_path: str, max_to_keep: int) -> list[str]:
    """Delete old steps and leftovers; return the paths deleted.

    Keeps the newest ``max_to_keep`` complete steps (-1 keeps all) and always the step the
    pointer names. Also deletes ``*.tmp-*`` directories (interrupted local saves) and
    manifest-less step directories older than the pointed step (failed uploads that can no
    longer be in flight). "Complete" here means "has a manifest": pruning does not hash files.
    Assumes one writer: run it from the process that commits, after a commit.
    """
    if not isinstance(max_to_keep, int) or max_to_keep < -1:
        raise CheckpointError(f"max_to_keep must be -1 (keep all) or >= 0, got {max_to_keep!r}")
    names = storage.list_dirs(ckpt_path)
    try:
        pointer = read_pointer(storage, ckpt_path)
    except ValueError:
        pointer = None
    doomed = [join(ckpt_path, name) for name in names if _TMP_MARK in name]
    complete, incomplete = [], []
    for step in sorted((s for s in map(parse_step, names) if s is not None), reverse=True):
        has_manifest = storage.exists(join(step_dir(ckpt_path, step), MANIFEST_FILE))
        (complete if has_manifest else incomplete).append(step)
    keep = set(complete if max_to_keep == -1 else complete[:max_to_keep])
    if pointer is not None:
        keep.add(pointer)
    doomed += [step_dir(ckpt_path, s) for s in complete if s not in keep]
    if pointer is not None:
        doomed += [step_dir(ckpt_path, s) for s in incomplete if s < pointer]
    for path in doomed:
        storage.rm_tree(path)
    return doomed


def download_checkpoint(storage: Storage, step_dir: str, local_dir: str | Path) -> dict[str, Any]:
    """Fetch a complete step into ``local_dir`` and verify every file against its manifest.

    Returns the manifest. Raises CheckpointError listing every missing or mismatched file.
    """
    try:
        text = storage.read_text(join(step_dir, MANIFEST_FILE))
        entries = parse_manifest(text)
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{step_dir}: no {MANIFEST_FILE}; not a complete checkpoint "
            "(pick another step, see find_resume_step)"
        ) from exc
    except ValueError as exc:
        raise CheckpointError(f"{step_dir}: unreadable {MANIFEST_FILE}: {exc}") from exc
    local_dir = Path(local_dir)
    problems = []
    for entry in entries:
        rel, target = entry["path"], local_dir / entry["path"]
        try:
            storage.get_file(join(step_dir, rel), target)
        except FileNotFoundError:
            problems.append(f"missing file {rel}")
            continue
        size = os.path.getsize(target)
        if size != entry["size"]:
            problems.append(
                f"size mismatch for {rel}: manifest says {entry['size']} bytes, downloaded {size}"
            )
        elif local_sha256(target) != entry["sha256"]:
            problems.append(f"checksum mismatch for {rel} (sha256 differs)")
    if problems:
        raise CheckpointError(
            f"checkpoint {step_dir} downloaded to {local_dir} is corrupt: " + "; ".join(problems)
        )
    (local_dir / MANIFEST_FILE).write_text(text)
    return json.loads(text)
