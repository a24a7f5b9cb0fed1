"""A turn's vision tower replayed from CUDA graphs, by the number of frames it encodes.

A small policy's turn is bound by the host (``clew.inference.prefill_graphs``), and after the
language model's layers the next largest share of a turn's host time is the vision tower:
its patch embedding, the position table's interpolation, a few blocks of norms, attention
and MLPs, and the mergers, each a kernel launch or several from transformers' Python, for
a few frames' worth of device work (BENCHMARKS.md, "The small-model regime"). As for the
prefill's layers, the tower is recorded once per shape and replayed with one launch.

The shape is the number of frames, rounded up (``rows_bucket``: 1, 2, 4, 8, then multiples
of 16) and the frame's patch grid: the padding frames are zeros, and each frame attends
within its own patches (``cu_seqlens``), so they change no real frame's output, which is
sliced out of the bucket's. What the tower works out on the host from the grid (the
interpolation of the position table, the rotary positions, ``cu_seqlens``) is computed once
per bucket by transformers' own helpers and passed in as the precomputed values those
helpers take (``transformers.vision_utils``), so the recorded forward holds no host
synchronisation; clew's one-call vision attention (``clew.kernels.vision_attention``) is
told the frames' length on the bucket's ``cu_seqlens`` for the same reason.

A bucket's first use checks its path against the tower's own forward on the same frames,
and, where it will be captured, that the path reads nothing back to the host (torch's sync
debug mode set to raise: a read, or a copy from pageable host memory, is an error inside a
capture). Where either fails (a transformers whose tower does not take those values, or
one that reads a length to the host), where the tower is not one this code recognises, or
where a capture fails, the graphs turn themselves off for the engine and say so, and the
tower runs eagerly from then on. ``CacheBatch`` enters ``routed`` for every forward of an
engine built with them; the tower is reached through ``clew.models.distinct_images``, after
the copies of a frame are set aside, so a bucket counts distinct frames.

On a device without CUDA graphs (``capture=False``) the same bucketed, padded tower runs
eagerly: what the CPU tests compare with the tower's own forward.
"""

from __future__ import annotations

import contextlib
import importlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from clew.inference.cuda_graphs import captured, rows_bucket
from clew.models.distinct_images import gathered, tower_runner

__all__ = ["VisionGraphs"]

# The tower's forward as wrapped below clew's copy finder: (tower, pixels, grid, **kwargs).
Tower = Callable[..., Any]
MAX_FRAMES = 1 << 12  # frames a bucket may hold; a larger forward runs eagerly


@dataclass
class _Bucket:
    """One shape's static input, its precomputed values, and its graph once captured."""

    pixels: torch.Tensor  # [frames * patches, patch values]
    grid: torch.Tensor  # [frames, 3], every row the frame's grid
    given: dict[str, Any]  # the values transformers' helpers take precomputed
    flags: dict[str, Any]  # the forward's other keyword arguments (return_dict, ...)
    checked: bool = False
    out: Any = None
    graph: torch.cuda.CUDAGraph | None = None


def _precomputed(tower: torch.nn.Module, grid: torch.Tensor) -> dict[str, Any] | None:
    """What a Qwen3-VL tower's forward would work out from ``grid``, under the keyword names
    transformers' helpers pop (None where this tower or transformers has no such helpers)."""
    try:
        utils = importlib.import_module("transformers.vision_utils")
        module = importlib.import_module(type(tower).__module__)
    except ImportError:  # pragma: no cover - clew needs a transformers with vision_utils
        return None
    names = (
        "get_vision_interpolation_indices_and_weights",
        "get_vision_position_ids",
        "get_vision_cu_seqlens",
    )
    if any(getattr(module, n, None) is None for n in names[:2]) or not all(
        hasattr(utils, n) for n in names
    ):
        return None
    if not all(
        hasattr(tower, a)
        for a in ("num_grid_per_side", "interpolation_mode", "interpolation_align_corners")
    ):
        return None
    merge = tower.config.spatial_merge_size
    indices, weights = utils.get_vision_interpolation_indices_and_weights(
        grid,
        num_grid_per_side=tower.num_grid_per_side,
        mode=tower.interpolation_mode,
        align_corners=tower.interpolation_align_corners,
        spatial_merge_size=merge,
    )
    cu_seqlens = utils.get_vision_cu_seqlens(grid)
    length = int(grid[0, 1] * grid[0, 2])  # every frame's patches: one size
    cu_seqlens._clew_length_range = (length, length)  # read by the one-call vision attention
    return {
        "interp_indices": indices,
        "interp_weights": weights,
        "position_ids": utils.get_vision_position_ids(grid, merge),
        "cu_seqlens": cu_seqlens,
    }


@contextlib.contextmanager
def _host_syncs_raise(on: bool) -> Iterator[None]:
    """Within the block (where ``on``), a CUDA operation that waits for the device (a read to
    the host, a copy from pageable memory) raises, as it would inside a capture."""
    if not on:
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        # torch warns once that the debug mode is a prototype; that is no news to a user.
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _same(a: Any, b: Any) -> bool:
    """Whether two tower outputs hold the same tensors, to float tolerance."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


class VisionGraphs:
    """The engine's vision tower by bucket of distinct frames (module docstring)."""

    def __init__(self, capture: bool) -> None:
        self.capture = capture
        self.enabled = True  # off for good once a bucket's check fails
        self.captures = 0  # graphs captured so far, and the seconds they took (benchmarks)
        self.capture_s = 0.0
        self.replays = 0  # forwards run through a bucket, captured or eager
        self._buckets: dict[tuple, _Bucket] = {}
        self._pool = None

    @property
    def shapes(self) -> set[tuple[int, ...]]:
        """(frames, t, h, w) of every bucket kept (tests, benchmarks)."""
        return {key[:4] for key in self._buckets}

    @contextlib.contextmanager
    def routed(self) -> Iterator[None]:
        """Within the block, in this thread, the vision tower runs through ``run``."""
        with tower_runner(self.run if self.enabled else None):
            yield

    def run(
        self,
        inner: Tower,
        tower: torch.nn.Module,
        pixels: torch.Tensor,
        grid: torch.Tensor,
        flags: dict[str, Any],
    ) -> Any | None:
        """The tower's output for ``pixels`` of ``grid``'s frames (all of one grid; ``flags``:
        the forward's other keyword arguments, such as ``return_dict``) through a bucket;
        None where no bucket takes it (the caller runs the tower itself)."""
        n = len(grid)
        if not self.enabled or n > MAX_FRAMES or pixels.shape[0] % n:
            return None
        frames = rows_bucket(n, MAX_FRAMES)
        per = pixels.shape[0] // n
        key = (frames, *(int(x) for x in grid[0].tolist()), per, pixels.shape[1], pixels.dtype)
        key += (tuple(sorted((k, repr(v)) for k, v in flags.items())),)
        bucket = self._buckets.get(key)
        if bucket is None:
            whole = grid[:1].repeat(frames, 1)
            given = _precomputed(tower, whole)
            if given is None:
                self._off("this vision tower does not take its positions precomputed")
                return None
            bucket = self._buckets[key] = _Bucket(
                pixels.new_zeros((frames * per, pixels.shape[1])), whole, given, dict(flags)
            )
        bucket.pixels[: n * per].copy_(pixels)
        bucket.pixels[n * per :].zero_()
        if not bucket.checked and not self._check(inner, tower, bucket):
            return None
        self.replays += 1
        if not self.capture:
            out = self._tower(inner, tower, bucket)
        else:
            if bucket.graph is None and not self._capture(inner, tower, bucket):
                return None
            assert bucket.graph is not None
            bucket.graph.replay()
            out = bucket.out
        return gathered(out, frames, torch.arange(n, device=pixels.device))

    @staticmethod
    def _tower(inner: Tower, tower: torch.nn.Module, bucket: _Bucket) -> Any:
        """What the graph records: the tower over the bucket, its values given."""
        return inner(tower, bucket.pixels, bucket.grid, **bucket.flags, **dict(bucket.given))

    def _check(self, inner: Tower, tower: torch.nn.Module, bucket: _Bucket) -> bool:
        """Whether the bucket's path gives the tower's own output, without reading back to
        the host where it will be captured (the first use of each)."""
        try:
            with _host_syncs_raise(self.capture and bucket.pixels.is_cuda):
                ours = self._tower(inner, tower, bucket)
        except (TypeError, RuntimeError, ValueError) as error:
            self._off(f"the tower does not run from its precomputed positions alone ({error})")
            return False
        theirs = inner(tower, bucket.pixels, bucket.grid, **bucket.flags)
        if not _same(ours, theirs):
            self._off("its output differs from the tower's own forward")
            return False
        bucket.checked = True
        return True

    def _off(self, why: str) -> None:
        """Turn the graphs off for good, saying why; the tower runs eagerly from then on."""
        self.enabled = False
        self._buckets.clear()
        warnings.warn(
            f"vision tower CUDA graphs are off for this engine: {why}; the tower runs eagerly",
            stacklevel=3,
        )

    def _capture(self, inner: Tower, tower: torch.nn.Module, bucket: _Bucket) -> bool:
        """Record the bucket's graph; False (and the graphs off) where the capture fails."""
        start = time.perf_counter()
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            run = lambda: self._tower(inner, tower, bucket)  # noqa: E731
            bucket.graph, bucket.out = captured(run, self._pool)
            torch.cuda.synchronize()
        except RuntimeError as error:
            self._off(f"its capture failed ({error})")
            return False
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        return True
