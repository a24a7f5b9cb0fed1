"""A turn's prefill with the language model's layers replayed from a CUDA graph.

A small policy's turn is bound by the host: the prefill forward of a 19M-parameter
Qwen3-VL launches several hundred kernels (norms, projections, rotary embeddings, cache
writes, attention, deepstack additions), each costing more host time to launch from
transformers' Python than the device spends running it, and a GRPO step runs one such
forward a turn (BENCHMARKS.md, "The small-model regime"). As for decode steps
(``clew.inference.cuda_graphs``), the layers are recorded once per shape and replayed with
one launch.

What runs where. The model's own forward still runs eagerly up to its language model: the
token embeddings, the vision tower (each distinct image once, ``clew.models.distinct_images``)
and the placement of the image features, whose sizes and host checks depend on the batch.
Inside ``routed`` (``CacheBatch`` enters it for the padded prefill of a whole batch with no
per-row adapters) the language model's ``forward`` is replaced by ``PrefillGraphs.run``,
which copies its inputs into a bucket's static tensors and replays the bucket's graph of:
the rotary embedding of the positions, every decoder layer over ``SlotCache`` (writing each
row's keys at the columns the cache planned, attending under the prefill's mask), the
deepstack features added after the first layers, and the final norm, of each row's last
position only (the one whose logits are sampled). transformers' own deepstack step selects
the image positions with a boolean index, a host synchronisation a graph cannot hold; here
each feature level is scattered eagerly into a zero ``[rows, T, hidden]`` tensor that the
graph adds whole (the same sums: every other position adds 0).

Buckets, as for decode steps: the rows rounded up (``rows_bucket``; padding rows live in
free slots of the cache, write their chunk at the end of their own slot and attend to all
of it, so they stay finite and touch no live row), the chunk's width (which ``CacheBatch``
pads to a multiple of ``CHUNK_WIDTH_STEP``: a reply and the env's message vary a turn's
chunks by a few tokens, and each width would be a capture of its own), and the columns the
attention reads rounded up to ``WIDTH_STEP`` (more columns masked, as for a shorter row).
A graph records the addresses of the cache's buffers, so the graphs of one set of buffers
are kept by their addresses, and the engine keeps the buffers between batches
(``clew.inference.kv_store``): a GRPO run's later steps replay what its first steps captured.

On a device without CUDA graphs (``capture=False``) the same bucketed, padded layers run
eagerly: what the CPU tests compare with the model's own forward.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from clew.errors import ClewError
from clew.inference.cuda_graphs import captured, rows_bucket, width_bucket
from clew.inference.kv_cache import SlotCache
from clew.kernels.thread_switch import ThreadSwitch

__all__ = ["CHUNK_WIDTH_STEP", "PrefillGraphs", "language_model", "routed"]

_RUNNER = ThreadSwitch()  # the runner of this thread's routed block, if any
CHUNK_WIDTH_STEP = 16  # a graphed prefill's chunk width, in columns, is a multiple of this
_KEEP_BUFFER_SETS = 2  # the graphs of this many sets of cache buffers (training, evaluation)


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The text model whose layers the graphs replay (``get_decoder``, through peft)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "get_decoder"):
        raise ClewError(f"{type(base).__name__} does not name its language model (get_decoder)")
    return base.get_decoder()


def _route(text_model: torch.nn.Module) -> None:
    """Wrap ``text_model.forward`` once: inside ``routed``, it goes to the block's runner."""
    if getattr(text_model, "_clew_prefill_routed", False):
        return
    inner = text_model.forward.__func__

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        runner = _RUNNER.value
        if runner is None or args or kwargs.get("inputs_embeds") is None:
            return inner(self, *args, **kwargs)
        out = runner(self, kwargs)
        return inner(self, *args, **kwargs) if out is None else out

    text_model.forward = types.MethodType(forward, text_model)
    text_model._clew_prefill_routed = True


@contextlib.contextmanager
def routed(
    graphs: PrefillGraphs, model: torch.nn.Module, kv: SlotCache, cache_kw: str
) -> Iterator[None]:
    """Within the block, in this thread, ``model``'s language model runs as ``graphs.run``."""
    text_model = language_model(model)
    _route(text_model)
    with _RUNNER.block(lambda module, kwargs: graphs.run(module, kwargs, kv, cache_kw)):
        yield


@dataclass
class _Bucket:
    """One shape's static inputs, its output, and its graph once captured."""

    embeds: torch.Tensor  # [R, T, H]
    pos: torch.Tensor  # [P, R, T]
    mask: torch.Tensor  # [R, 1, T, W] bool
    cols: torch.Tensor  # [R, T]: the columns each row writes
    slots: torch.Tensor  # [R, 1]: the slots they write (0..R-1; the graph outlives the cache)
    deep: list[torch.Tensor]  # [R, T, H] per deepstack level
    out: torch.Tensor | None = None  # [R, 1, H]
    graph: torch.cuda.CUDAGraph | None = None


class PrefillGraphs:
    """The engine's prefill layers by bucket, over the cache buffers they were captured on."""

    def __init__(self, capture: bool) -> None:
        self.capture = capture
        self.captures = 0  # graphs captured so far, and the seconds they took (benchmarks)
        self.capture_s = 0.0
        self.replays = 0  # forwards run through a bucket, captured or eager
        self.last_shape: tuple[int, int, int] | None = None  # (rows, chunk, width)
        self._by_buffers: OrderedDict[tuple[int, ...], dict[tuple, _Bucket]] = OrderedDict()
        self._pool = None

    @property
    def shapes(self) -> set[tuple[int, int, int]]:
        """The (rows, chunk, width) of every bucket kept (benchmarks, tests)."""
        return {key[:3] for buckets in self._by_buffers.values() for key in buckets}

    def run(
        self, text_model: torch.nn.Module, kwargs: dict[str, Any], kv: SlotCache, cache_kw: str
    ) -> BaseModelOutputWithPast | None:
        """The language model's output for the prefill in ``kwargs`` (its last position's
        final hidden state a row, ``[rows, 1, hidden]``), through a bucket (module docstring);
        None where no bucket can take it (a batch's first forward, before its buffers
        exist), which then runs the model's own layers."""
        embeds: torch.Tensor = kwargs["inputs_embeds"]
        pos: torch.Tensor = kwargs["position_ids"]
        mask: torch.Tensor = kwargs["attention_mask"]
        deep = list(kwargs.get("deepstack_visual_embeds") or [])
        plan = kv.planned
        b, t, h = embeds.shape
        if (
            plan is None
            or plan[2:] != (0, b)
            or mask is None
            or mask.dtype != torch.bool
            or mask.dim() != 4
            or pos.dim() != 3
            or any(layer.keys is None for layer in kv.layers)
        ):
            return None  # not a whole batch's padded prefill over existing buffers
        r = rows_bucket(b, kv.slots)
        cols, width = plan[:2]
        w = width_bucket(width, kv.capacity)
        self.last_shape = (r, t, w)
        buckets = self._buckets(kv)
        key = (r, t, w, pos.shape[0], len(deep), embeds.dtype)
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = self._bucket(kv, r, t, w, pos.shape[0], len(deep), embeds)
        self._fill(bucket, embeds, pos, mask, cols, width, deep, kwargs.get("visual_pos_masks"))
        kv.plan_write(bucket.cols, w, bucket.slots)  # slot i writes the bucket's row i
        self.replays += 1
        if not self.capture:
            out = self._layers(text_model, bucket, kv, cache_kw)
        else:
            if bucket.graph is None:
                self._capture(text_model, bucket, kv, cache_kw)
            assert bucket.graph is not None and bucket.out is not None
            bucket.graph.replay()
            out = bucket.out
        return BaseModelOutputWithPast(last_hidden_state=out[:b], past_key_values=kv)

    def _buckets(self, kv: SlotCache) -> dict[tuple, _Bucket]:
        """The buckets captured over ``kv``'s buffers (their addresses and shapes)."""
        key = tuple(v for x in kv.buffers() for v in (x.data_ptr(), *x.shape))
        if key not in self._by_buffers:
            self._by_buffers[key] = {}
            while len(self._by_buffers) > _KEEP_BUFFER_SETS:
                self._by_buffers.popitem(last=False)
        self._by_buffers.move_to_end(key)
        return self._by_buffers[key]

    @staticmethod
    def _bucket(
        kv: SlotCache, r: int, t: int, w: int, axes: int, levels: int, like: torch.Tensor
    ) -> _Bucket:
        dev, h = like.device, like.shape[-1]
        return _Bucket(
            embeds=like.new_zeros((r, t, h)),
            pos=torch.zeros((axes, r, t), dtype=torch.long, device=dev),
            mask=torch.ones((r, 1, t, w), dtype=torch.bool, device=dev),
            # Padding rows write their chunk at the end of their own free slot.
            cols=(kv.capacity - t + torch.arange(t, device=dev))[None].repeat(r, 1),
            slots=torch.arange(r, device=dev)[:, None],
            deep=[like.new_zeros((r, t, h)) for _ in range(levels)],
        )

    @staticmethod
    def _fill(
        bucket: _Bucket,
        embeds: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        cols: torch.Tensor,
        width: int,
        deep: list[torch.Tensor],
        visual: torch.Tensor | None,
    ) -> None:
        """The live rows' inputs into the bucket; padding rows keep theirs (zeros, all
        visible, the end of their slot), which nothing overwrites."""
        b, t, h = embeds.shape
        bucket.embeds[:b].copy_(embeds)
        bucket.pos[:, :b].copy_(pos)
        bucket.cols[:b].copy_(cols)
        bucket.mask[:b, :, :, :width].copy_(mask)
        bucket.mask[:b, :, :, width:] = False
        if deep:
            assert visual is not None, "deepstack features come with their positions"
            at = visual[:b].reshape(-1).nonzero().squeeze(1)
            for dense, features in zip(bucket.deep, deep, strict=True):
                dense.zero_()
                dense[:b].view(-1, h).index_copy_(0, at, features.to(dense.dtype))

    @staticmethod
    def _layers(
        text_model: torch.nn.Module, bucket: _Bucket, kv: SlotCache, cache_kw: str
    ) -> torch.Tensor:
        """What the graph records: the decoder layers over the bucket, the last position's
        final norm ``[R, 1, H]``."""
        hidden = bucket.embeds
        rotary = text_model.rotary_emb(hidden, bucket.pos)
        for i, layer in enumerate(text_model.layers):
            out = layer(
                hidden,
                attention_mask=bucket.mask,
                position_embeddings=rotary,
                use_cache=True,
                **{cache_kw: kv},
            )
            hidden = out[0] if isinstance(out, tuple) else out
            if i < len(bucket.deep):
                hidden = hidden + bucket.deep[i]
        return text_model.norm(hidden[:, -1:])

    def _capture(
        self, text_model: torch.nn.Module, bucket: _Bucket, kv: SlotCache, cache_kw: str
    ) -> None:
        start = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            # The warm-up writes the same columns the replay then writes.
            graph, bucket.out = captured(
                lambda: self._layers(text_model, bucket, kv, cache_kw), self._pool
            )
        except RuntimeError as error:
            rows, chunk, width = self.last_shape or (0, 0, 0)
            raise ClewError(
                f"capturing a prefill of {rows} rows of {chunk} tokens over {width} cache "
                f"columns as a CUDA graph failed ({error}); set "
                "generator.inference_engine.prefill_cuda_graphs=false to prefill eagerly"
            ) from error
        bucket.graph = graph
        torch.cuda.synchronize()
        self.captures += 1
        self.capture_s += time.perf_counter() - start
