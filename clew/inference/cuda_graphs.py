"""Decode steps replayed from CUDA graphs, over fixed shapes of the in-place KV cache.

A decode step of an 8B policy in eager mode launches about a thousand small kernels (36
layers of norms, projections, rotary embeddings, cache writes and attention), and the host
time to launch them was most of the step, several times the GPU's own work at large batches
(BENCHMARKS.md). A CUDA graph records the step's kernels once and
replays them with one launch. vLLM and SGLang do the same; clew captures the step of its own
engine (transformers' model forward over ``SlotCache``) rather than compiling the model, so
nothing is traced or compiled and the graph runs exactly the eager step's kernels.

A graph fixes every shape and address it touches, so a step runs over a *bucket*:

- rows: the batch's rows rounded up (1, 2, 4, 8, then multiples of 16, at most the cache's
  slots). The padding rows live in free slots of the cache: they feed the pad token at
  position 0, write their keys into the last column of their own free slot (which nothing
  reads before a row joining there has overwritten it) and attend to what that slot's
  ``visible`` row shows, its first column marked visible by the step, so they stay finite
  and touch no live row;
- width: the columns the attention reads, the longest live row rounded up to a multiple of
  ``WIDTH_STEP`` (at most the capacity); the extra columns are masked as they are in eager
  mode for rows shorter than the longest.

The step's inputs (token ids, M-RoPE positions, each row's write column, the attention mask
copied from the cache's ``visible`` table) are copied into the bucket's static tensors
before each replay, and the logits come out in one buffer shared by every bucket. The
graphs of a batch share one memory pool and are captured on first use; a cache growth
(``SlotCache.generation``) moves the buffers the graphs read, so it drops them.

With ``attention="varlen"`` (``generator.inference_engine.decode_attention=varlen``) the
width is the whole capacity, and the step passes each row's length
(``clew.kernels.slot_views.row_lengths``, a static tensor updated before each replay): each
row reads its own columns through the variable-length kernel, with no mask and no block
table, and one graph per row count serves every width. While an image column is hidden
anywhere in the cache (``SlotCache.hidden_any``) a row's visible columns are no longer its
first ``length``, so those steps take the masked SDPA step instead (graphs of their own).
``attention="triton"`` is the same step through clew's split-KV kernel
(``clew.kernels.split_decode``).

On a device without CUDA graphs (the CPU), ``capture=False`` runs the same bucketed,
padded step eagerly: what the CPU tests check against the plain path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from clew.errors import ClewError
from clew.inference.kv_cache import SlotCache
from clew.kernels.slot_views import row_lengths

# Attention width granularity: at 8B and 192 rows each extra column costs about 28 MB of
# KV reads a step, while each distinct width is one more capture (its time and graph memory).
WIDTH_STEP = 256
BY_LENGTH = ("varlen", "triton")  # the attentions that read each row's length, not a mask

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
T = TypeVar("T")


def captured(run: Callable[[], T], pool: tuple) -> tuple[torch.cuda.CUDAGraph, T]:
    """``run`` recorded as a CUDA graph in the memory ``pool``, and what it returned while
    recording (tensors in the pool, which every replay rewrites). A warm-up run on a side
    stream comes first (cuBLAS workspaces, lazy initialisations), as torch's CUDA-graph
    notes ask. A failed capture raises torch's ``RuntimeError``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA work (a server's, a logger's) may go on.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = run()
    return graph, out


def rows_bucket(rows: int, slots: int) -> int:
    """The padded row count a step of ``rows`` rows runs at."""
    bucket = 1 << max(0, rows - 1).bit_length() if rows <= 8 else -(-rows // 16) * 16
    return min(bucket, slots)


def width_bucket(width: int, capacity: int) -> int:
    """The attention width a step whose longest row has ``width`` columns reads."""
    return min(-(-width // WIDTH_STEP) * WIDTH_STEP, capacity)


@dataclass
class _Step:
    """One bucket's static inputs (and its graph, once captured)."""

    ids: torch.Tensor  # [R, 1]
    pos: torch.Tensor  # [3, R, 1]
    cols: torch.Tensor  # [R, 1]: the column each row writes
    mask: torch.Tensor  # [R, 1, 1, W]; [R, 1, 1, 1] by lengths, unread
    graph: torch.cuda.CUDAGraph | None = None
    lengths: torch.Tensor | None = None  # varlen, triton: [R] columns each row reads
    kernel: str = "efficient"  # varlen_decode's kernel: "triton" for triton


class DecodeGraphs:
    """The decode steps of one ``CacheBatch`` over its ``SlotCache`` (module docstring)."""

    def __init__(
        self, cache: SlotCache, pad_id: int, *, capture: bool, attention: str = "sdpa"
    ) -> None:
        self.cache = cache
        self.pad_id = pad_id
        self.capture = capture
        self.attention = attention  # "sdpa", "varlen", "triton" (docstring)
        self.captures = 0  # graphs captured so far, and the seconds they took (benchmarks)
        self.capture_s = 0.0
        self.last_shape: tuple[int, int] | None = None  # the last step's (rows, width)
        self.last_mode = attention  # and its attention (by lengths: "sdpa" at times)
        self._steps: dict[tuple[int, int, str], _Step] = {}  # (rows, width, attention)
        self._generation = cache.generation
        self._pool = None
        self._logits: torch.Tensor | None = None  # [slots, vocab], shared by every bucket

    def step(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        active: torch.Tensor,
        active_host: list[bool],
        forward: Forward,
    ) -> torch.Tensor:
        """One decode step of every row (``ids`` [rows, 1], ``pos`` [3, rows, 1], ``active``
        and ``active_host`` as for ``SlotCache.decode``); returns the rows' logits.
        ``forward(ids, pos, mask)`` is the engine's forward over the planned cache."""
        cache = self.cache
        if cache.generation != self._generation:
            self._steps.clear()
            self._pool, self._logits, self._generation = None, None, cache.generation
        b = ids.shape[0]
        cols = cache.advance(active, active_host)
        r = rows_bucket(b, cache.slots)
        mode = "sdpa" if self.attention in BY_LENGTH and cache.hidden_any else self.attention
        w = cache.capacity if mode != "sdpa" else width_bucket(cache.width, cache.capacity)
        self.last_shape, self.last_mode = (r, w), mode
        step = self._steps.get((r, w, mode))
        if step is None:
            step = self._steps[(r, w, mode)] = self._inputs(r, w, mode)
        self._fill(step, ids, pos, cols, b)
        cache.plan_write(step.cols, w)
        if not self.capture:
            return self._run(step, forward)[:b]
        if step.graph is None:
            self._capture(step, forward)
        step.graph.replay()
        return self._logits[:b]

    @staticmethod
    def _run(step: _Step, forward: Forward) -> torch.Tensor:
        if step.lengths is None:
            return forward(step.ids, step.pos, step.mask)
        with row_lengths(step.lengths, step.kernel):
            return forward(step.ids, step.pos, step.mask)

    def _inputs(self, r: int, w: int, mode: str) -> _Step:
        dev = self.cache.device
        step = _Step(
            ids=torch.full((r, 1), self.pad_id, dtype=torch.long, device=dev),
            pos=torch.zeros((3, r, 1), dtype=torch.long, device=dev),
            cols=torch.full((r, 1), self.cache.capacity - 1, dtype=torch.long, device=dev),
            # By lengths: transformers wants a mask; the attention reads the lengths instead.
            mask=torch.zeros(
                (r, 1, 1, 1 if mode in BY_LENGTH else w), dtype=torch.bool, device=dev
            ),
        )
        if mode in BY_LENGTH:
            step.lengths = torch.ones(r, dtype=torch.long, device=dev)
            step.kernel = "triton" if mode == "triton" else "efficient"
        return step

    def _fill(
        self, step: _Step, ids: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor, b: int
    ) -> None:
        r = step.ids.shape[0]
        step.ids[:b].copy_(ids)
        step.pos[:, :b].copy_(pos)
        step.cols[:b, 0].copy_(cols)
        if b < r:  # padding rows, in free slots (module docstring)
            step.ids[b:] = self.pad_id
            step.pos[:, b:] = 0
            step.cols[b:] = self.cache.capacity - 1
            # A free slot's table is reset when a row joins there (SlotCache.add_rows).
            self.cache.visible[b:r, 0] = True
        if step.lengths is not None:  # by lengths: each row's new length; padding rows read 1
            step.lengths[:b].copy_(self.cache.fill_dev[:b])
            step.lengths[b:] = 1
        else:
            step.mask[:, 0, 0].copy_(self.cache.visible[:r, : step.mask.shape[-1]])

    def _capture(self, step: _Step, forward: Forward) -> None:
        start = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()

        def run() -> None:  # the warm-up writes the same keys the replay then writes
            logits = self._run(step, forward)
            if not torch.cuda.is_current_stream_capturing():
                return
            if self._logits is None:
                # Allocated in the pool by the first capture, kept alive for later ones.
                self._logits = logits.new_empty((self.cache.slots, logits.shape[-1]))
            self._logits[: logits.shape[0]].copy_(logits)

        try:
            graph, _ = captured(run, self._pool)
        except RuntimeError as error:
            rows, width = self.last_shape or (step.ids.shape[0], 0)
            raise ClewError(
                f"capturing a decode step of {rows} rows over {width} cache columns as a "
                f"CUDA graph failed ({error}); set generator.inference_engine.enforce_eager="
                "true (clew eval --enforce-eager) to step eagerly"
            ) from error
        step.graph = graph
        torch.cuda.synchronize()
        self.captures += 1
        self.capture_s += time.perf_counter() - start
