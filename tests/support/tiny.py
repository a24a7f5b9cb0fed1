"""Tiny policies and data sets for the tests, built once per test process and shared.

Each builder is a plain function, cached by its arguments: the first call builds (a tiny
policy takes a second or two, a data set less), every later call with the same arguments
returns the same path. The paths lie under one folder of the session's temporary directory
(``use_root``, called from ``tests/conftest.py``), else under a folder of the system's
temporary directory that is removed at exit.

A returned path is shared by every test of the process: never write into it. A test that
changes its model directory (an export into it, ``save_pretrained`` over it, an edited
config) takes its own copy (``policy_copy``). ``tests/conftest.py`` calls
``check_untouched`` after each test module: a shared directory or file that a module changed
fails that module and is dropped from the cache, so that later modules get a fresh one.

- ``tiny_policy(**build_args)``: the directory ``clew.models.build_model`` writes for the
  ``tiny`` preset and ``build_args``: any of its keyword arguments but ``output_dir`` and
  ``overwrite`` (``corpus`` too, as a keyword).
- ``digits_policy()``: the policy of the ``test/digits`` GRPO runs (a digits corpus, 28 px).
- ``wide_policy()``: a 56 px policy of hidden size 192, one whose adapters fit no other.
- ``policy_copy(dest, **build_args)``: a private, writable copy of ``tiny_policy(...)``.
- ``digits_data(n, split)``: a parquet of ``envs_for_tests.digits_rows(n, split)``.
- ``env_data(env_id, n, split, **generate_args)``: a parquet of
  ``clew.data.rows.generate_rows(env_id, n, split, **generate_args)``.
- ``watch(path)``: check a shared folder built elsewhere too (``real_qwen3vl_dir``).
- ``cached_path(kind, args, make)``: the same cache for other built files (the serve
  tests' LoRA adapters, ``support.serve_cases.make_adapter``).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "DIGITS_CORPUS",
    "cached_path",
    "check_untouched",
    "digits_data",
    "digits_policy",
    "env_data",
    "policy_copy",
    "tiny_policy",
    "use_root",
    "watch",
    "wide_policy",
]

# The text of the digits runs (``envs_for_tests.DigitsEnv``): one token per digit.
DIGITS_CORPUS = ("0123456789 " * 20,)

_lock = threading.RLock()
_root: Path | None = None
_built: dict[str, Path] = {}  # cache key -> path
_prints: dict[Path, dict[str, tuple[int, int]]] = {}  # path -> its files' (size, mtime)


def use_root(path: str | Path) -> None:
    """Build under ``path`` from now on (the session's temporary folder)."""
    global _root
    with _lock:
        _root = Path(path)
        _root.mkdir(parents=True, exist_ok=True)


def _folder() -> Path:
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="clew-tiny-"))
        atexit.register(shutil.rmtree, _root, ignore_errors=True)
    return _root


def _key(kind: str, args: dict[str, Any]) -> str:
    return kind + json.dumps(args, sort_keys=True, default=list)


def _name(kind: str, key: str, readable: str, suffix: str) -> str:
    return f"{kind}-{readable}-{hashlib.sha1(key.encode()).hexdigest()[:10]}{suffix}"


def _fingerprint(path: Path) -> dict[str, tuple[int, int]]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    out = {}
    for f in files:
        stat = f.stat()
        out[str(f.relative_to(path)) if f != path else "."] = (stat.st_size, stat.st_mtime_ns)
    return out


def cached_path(
    kind: str, args: dict[str, Any], make: Callable[[Path], object], readable: str = "",
    suffix: str = "",
) -> Path:  # fmt: skip
    """The path ``make(path)`` wrote, once per process for ``kind`` and ``args`` (any JSON):
    the cache under the builders above, for support modules that share other built files.
    ``readable`` and ``suffix`` go into the file's name."""
    return _cached(kind, args, readable or "built", make, suffix)


def _cached(kind: str, args: dict[str, Any], readable: str, make, suffix: str = "") -> Path:
    key = _key(kind, args)
    with _lock:
        path = _built.get(key)
        if path is None:
            path = _folder() / _name(kind, key, readable, suffix)
            if path.exists():  # dropped by check_untouched: start again
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            make(path)
            _built[key] = path
            _prints[path] = _fingerprint(path)
        return path


def tiny_policy(**build_args: Any) -> Path:
    """The directory ``build_model`` writes for the ``tiny`` preset and ``build_args``, built
    once per process.

    Shared: never write into it (see the module docstring).
    """
    from clew.models import build_model

    if {"output_dir", "overwrite", "preset"} & build_args.keys():
        raise TypeError("tiny_policy chooses the preset, folder and overwrite itself")
    readable = "-".join(
        str(build_args[k]) for k in ("arch", "image_size", "dtype") if build_args.get(k)
    )
    return _cached(
        "policy",
        build_args,
        readable or "default",
        lambda path: build_model("tiny", path, **build_args),
    )


def digits_policy() -> Path:
    """The tiny policy of the ``test/digits`` GRPO runs: a digits corpus, 28 px frames."""
    return tiny_policy(corpus=list(DIGITS_CORPUS), image_size=28)


def wide_policy() -> Path:
    """A 56 px tiny policy of hidden size 192: an adapter of it fits no other tiny policy."""
    return tiny_policy(image_size=56, text_overrides={"hidden_size": 192})


def policy_copy(dest: str | Path, **build_args: Any) -> Path:
    """A copy of ``tiny_policy(**build_args)`` at ``dest``, the caller's to change."""
    return Path(shutil.copytree(tiny_policy(**build_args), dest))


# The smallest GRPO run over the digits rows: one-turn episodes of a few tokens, 4 prompts x
# 2 samples a step, one micro-batch (the sweep tests' runs).
# A recipe's GRPO stage at a size that runs in seconds: 2 steps of 2 prompts x 2 samples.
TINY_GRPO = (
    "trainer.max_steps=2",
    "trainer.train_batch_size=2",
    "trainer.policy_mini_batch_size=2",
    "generator.n_samples_per_prompt=2",
    "trainer.micro_train_batch_size_per_gpu=4",
    "trainer.micro_forward_batch_size_per_gpu=4",
)

DIGITS_GRPO_SHAPE = (
    "trainer.train_batch_size=4",
    "trainer.policy_mini_batch_size=4",
    "trainer.micro_train_batch_size_per_gpu=8",
    "trainer.hf_save_interval=-1",
    "trainer.max_prompt_length=128",
    "generator.n_samples_per_prompt=2",
    "generator.max_turns=1",
    "generator.sampling_params.max_generate_length=4",
    "generator.max_input_length=512",
)


def digits_data(n: int, split: str = "train") -> Path:
    """A parquet of ``envs_for_tests.digits_rows(n, split)``, written once per process.

    Imports ``envs_for_tests``, which registers ``test/digits`` in this process."""
    from envs_for_tests import digits_rows

    from clew.data.rows import write_rows

    def make(path: Path) -> None:
        write_rows(digits_rows(n, split), path)

    return _cached("data", {"digits": n, "split": split}, f"digits-{split}-{n}", make, ".parquet")


def env_data(env_id: str, n: int, split: str = "train", **generate_args: Any) -> Path:
    """A parquet of ``generate_rows(env_id, n, split, **generate_args)``, written once."""
    from clew.data.rows import generate_rows, write_rows

    args = {"env_id": env_id, "n": n, "split": split, **generate_args}
    readable = f"{env_id.replace('/', '_')}-{split}-{n}"

    def make(path: Path) -> None:
        write_rows(generate_rows(env_id, n, split, **generate_args), path)

    return _cached("data", args, readable, make, ".parquet")


def watch(path: str | Path) -> Path:
    """Have ``check_untouched`` watch ``path`` too (a shared folder built elsewhere)."""
    path = Path(path)
    with _lock:
        _built[_key("watched", {"path": str(path)})] = path
        _prints[path] = _fingerprint(path)
    return path


def check_untouched() -> list[Path]:
    """The shared paths whose files changed since they were built (each dropped from the
    cache, so the next call builds it again); empty when none did."""
    changed = []
    with _lock:
        for key, path in list(_built.items()):
            if not path.exists() or _fingerprint(path) != _prints[path]:
                changed.append(path)
                del _built[key]
                del _prints[path]
    return changed
