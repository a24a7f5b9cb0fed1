"""``EngineProfile``: where an engine's rollout spends its time, beside the bounds.

It wraps ``CacheBatch``'s and ``DecodeGraphs``' methods while it is installed and times each
forward between device synchronizations; ``benchmarks/rollout.py --profile`` prints its
report (that module's docstring says what each part holds).
"""

from __future__ import annotations

import contextlib
import time
from contextlib import contextmanager

import torch
from bounds import Hardware


class EngineProfile:
    """Seconds and work of the engine's forwards, timed by wrapping ``CacheBatch``'s methods."""

    def __init__(self, device: torch.device, pad_id: int, kernels: bool = False) -> None:
        self.device, self.pad_id, self.kernels = device, pad_id, kernels
        self.engine_s = self.prefill_s = self.decode_s = 0.0
        self.prefill_tokens = self.decode_steps = 0
        self.prefill_columns = 0  # rows x width of the prefill forwards, padding included
        self.prefill_patches = 0  # vision patches of the prefill forwards
        self.prefill_pairs = 0  # query-key pairs of their attention (each row's, causal)
        self.kv_tokens_read = 0  # live cache tokens summed over decode steps
        self.vision_s = 0.0  # the vision tower's forwards, inside the prefill forwards
        self.prefill_forwards = 0
        # With ``kernels``: {kernel: [own device us, calls]} over every prefill forward,
        # each forward profiled on its own (which slows it: time a plain run apart).
        self.prefill_kernels: dict[str, list[float]] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _profiled(self, fn, *args, **kwargs):
        """``fn``'s result, its kernels added to ``prefill_kernels``."""
        from kernel_kinds import add_times, own_times
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as p:
            out = fn(*args, **kwargs)
            self._sync()
        add_times(self.prefill_kernels, own_times(p, cuda))
        return out

    @contextmanager
    def _vision_timed(self, model: torch.nn.Module):
        """Times the vision tower's forwards (``model.model.visual``) between synchronizations."""
        visual = getattr(getattr(model, "model", model), "visual", None)
        if visual is None:
            yield
            return
        start = [0.0]

        def before(*_):
            self._sync()
            start[0] = time.perf_counter()

        def after(*_):
            self._sync()
            self.vision_s += time.perf_counter() - start[0]

        hooks = [visual.register_forward_pre_hook(before), visual.register_forward_hook(after)]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()

    @contextmanager
    def installed(self, model: torch.nn.Module | None = None):
        """Times the engine's parts while in effect; with ``model``, its vision tower too."""
        from clew.inference.cache_batch import CacheBatch
        from clew.inference.cuda_graphs import DecodeGraphs

        forward, extend = CacheBatch._forward, CacheBatch.extend_and_generate
        graph_step = DecodeGraphs.step
        prof = self
        in_graph_step = [False]

        def timed_forward(batch, input_ids, positions, attention_mask, **extra):
            if in_graph_step[0]:  # a capture's forward: the graph step is timed whole
                return forward(batch, input_ids, positions, attention_mask, **extra)
            prefill = input_ids.shape[1] > 1
            prof._sync()
            t0 = time.perf_counter()
            if prefill and prof.kernels:
                out = prof._profiled(forward, batch, input_ids, positions, attention_mask, **extra)
            else:
                out = forward(batch, input_ids, positions, attention_mask, **extra)
            prof._sync()
            dt = time.perf_counter() - t0
            if prefill:
                prof.prefill_s += dt
                prof.prefill_forwards += 1
                keep = extra.get("keep")  # a packed prefill: one row of every real token
                if keep is None:
                    new = (input_ids != prof.pad_id).sum(1).tolist()
                else:
                    ends = [-1, *keep.tolist()]
                    new = [b - a for a, b in zip(ends, ends[1:], strict=False)]
                prof.prefill_tokens += sum(new)
                prof.prefill_columns += input_ids.numel()
                if "pixel_values" in extra:
                    prof.prefill_patches += extra["pixel_values"].shape[0]
                # The rows' lengths count the chunk already: its i-th token sees
                # length - new + i keys.
                rows = extra.get("rows") or slice(0, len(batch.lengths))
                prof.prefill_pairs += sum(
                    n * length - n * (n - 1) // 2
                    for n, length in zip(new, batch.lengths[rows], strict=True)
                )
            else:
                prof.decode_s += dt
                prof.decode_steps += 1
                prof.kv_tokens_read += sum(batch.lengths)
            return out

        def timed_extend(batch, chunks, params):
            prof._sync()
            t0 = time.perf_counter()
            out = extend(batch, chunks, params)
            prof._sync()
            prof.engine_s += time.perf_counter() - t0
            return out

        def timed_graph_step(graphs, ids, pos, active, active_host, fwd):
            prof._sync()
            t0 = time.perf_counter()
            in_graph_step[0] = True
            try:
                out = graph_step(graphs, ids, pos, active, active_host, fwd)
            finally:
                in_graph_step[0] = False
            prof._sync()
            prof.decode_s += time.perf_counter() - t0
            prof.decode_steps += 1
            prof.kv_tokens_read += sum(graphs.cache.fill)
            return out

        CacheBatch._forward, CacheBatch.extend_and_generate = timed_forward, timed_extend
        DecodeGraphs.step = timed_graph_step
        try:
            with self._vision_timed(model) if model is not None else contextlib.nullcontext():
                yield self
        finally:
            CacheBatch._forward, CacheBatch.extend_and_generate = forward, extend
            DecodeGraphs.step = graph_step

    def report(self, total_s: float, sizes, hw: Hardware) -> None:
        prefill_bound = hw.compute_s(2 * sizes.params * self.prefill_tokens)
        decode_bound = hw.memory_s(
            self.decode_steps * sizes.text_weight_bytes
            + self.kv_tokens_read * sizes.kv_bytes_per_token
        )
        other = self.engine_s - self.prefill_s - self.decode_s
        outside = total_s - self.engine_s
        print(f"rollout profile ({hw.tflops:g} TFLOP/s, {hw.tbs:g} TB/s): {total_s:.2f} s")
        print(f"{'part':<28} {'seconds':>8} {'share':>6} {'bound s':>8} {'of bound':>8}")
        parts = [
            ("prefill forwards", self.prefill_s, prefill_bound),
            ("decode forwards", self.decode_s, decode_bound),
            ("engine work around them", other, None),
            ("outside the engine", outside, None),
            ("whole rollout", total_s, prefill_bound + decode_bound),
        ]
        for name, sec, bound in parts:
            tail = f"{bound:>8.2f} {bound / sec:>8.1%}" if bound is not None and sec > 0 else ""
            print(f"{name:<28} {sec:>8.2f} {sec / total_s:>6.0%} {tail}")
        work = sizes.prefill_work(self.prefill_tokens, self.prefill_patches, self.prefill_pairs)
        if self.prefill_s > 0 and sizes.text_body_params:
            work_s = hw.compute_s(work)
            print(
                f"prefill work, vision per patch and attention counted ({self.prefill_patches} "
                f"patches, {self.prefill_pairs / 1e6:,.1f}M query-key pairs): "
                f"{work / 1e12:,.1f} TFLOP against the convention's "
                f"{2 * sizes.params * self.prefill_tokens / 1e12:,.1f}; bound {work_s:.2f} s, "
                f"{work_s / self.prefill_s:.1%} of it reached"
            )
        if self.vision_s > 0 and sizes.text_body_params:
            vision_b = hw.compute_s(2 * sizes.vision_params * self.prefill_patches)
            text_b = hw.compute_s(work) - vision_b
            text_s = self.prefill_s - self.vision_s
            print(
                f"prefill forwards: vision tower {self.vision_s:.2f} s (bound {vision_b:.2f} s, "
                f"{vision_b / self.vision_s:.1%}), the language model and the rest "
                f"{text_s:.2f} s (bound {text_b:.2f} s, {text_b / max(text_s, 1e-9):.1%})"
            )
        print(
            f"prefill: {self.prefill_tokens} tokens ({self.prefill_columns} with padding), "
            f"{self.prefill_tokens / max(self.prefill_s, 1e-9):,.0f} "
            f"tokens/s (bound {hw.tflops * 1e12 / (2 * sizes.params):,.0f}); decode: "
            f"{self.decode_steps} steps, {1000 * self.decode_s / max(self.decode_steps, 1):.1f} ms a "
            f"step (bound {1000 * decode_bound / max(self.decode_steps, 1):.1f} ms)"
        )

    def kernel_report(self) -> list[str]:
        """Device time of a prefill forward by kernel kind (``kernels`` on)."""
        from kernel_kinds import kind_table

        n = max(self.prefill_forwards, 1)
        total = sum(us for us, _ in self.prefill_kernels.values())
        head = (
            f"prefill kernels: {n} forwards, {total / 1e6:.2f} s of device time "
            f"({total / n / 1e3:.2f} ms a forward)"
        )
        return [head, *kind_table(self.prefill_kernels, n, "forward")]
