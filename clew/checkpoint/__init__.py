"""Checkpoints: where they are stored and how a step is committed, verified and resumed.

``storage`` hides local disk vs S3; ``layout`` holds the SkyRL-compatible directory layout
and the commit protocol that makes a crash mid-save harmless.
"""

from clew.checkpoint.layout import (
    MANIFEST_FILE,
    POINTER_FILE,
    build_manifest,
    commit_checkpoint,
    download_checkpoint,
    find_resume_step,
    list_steps,
    prune_checkpoints,
    read_pointer,
    step_dir,
    verify_checkpoint,
)
from clew.checkpoint.retry import RetryPolicy, is_transient
from clew.checkpoint.storage import Storage, join

__all__ = [
    "MANIFEST_FILE",
    "POINTER_FILE",
    "RetryPolicy",
    "Storage",
    "build_manifest",
    "commit_checkpoint",
    "download_checkpoint",
    "find_resume_step",
    "is_transient",
    "join",
    "list_steps",
    "prune_checkpoints",
    "read_pointer",
    "step_dir",
    "verify_checkpoint",
]
