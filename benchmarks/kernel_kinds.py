"""Device time by kernel kind: the classifier ``decode.py --kernels`` and ``rollout.py
--prefill-kernels`` print their tables with.

Kernels are filed by name (cuBLAS, CUTLASS, FlashAttention, torch's and Inductor's kernels);
the first kind that matches wins. On a CPU the same tables hold operators' own time.
"""

from __future__ import annotations

import re

KERNEL_KINDS = (  # attention first: its CUTLASS kernels (fmha_cutlassF) are not products
    # clew's Triton kernels by name ("prefill_kernel" would otherwise be a "fill" copy)
    ("attention", r"fmha|flash|attention|efficient|sdpa|prefill_kernel|split_kernel|combine_k"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|cublas|splitk|gemv|aten::(add|b)?mm\b"),
    ("norm", r"rms|norm"),
    ("sampling", r"softmax|multinomial|sort|topk|argmax|exponential|distribution|cumsum"),
    ("copy", r"copy|cat|index|scatter|gather|fill"),
    ("element-wise", r"elementwise|vectorized|unrolled|triton|reduce"),
)


def kind_of(name: str) -> str:
    return next((k for k, rx in KERNEL_KINDS if re.search(rx, name, re.I)), "other")


def own_times(prof, cuda: bool) -> dict[str, list[float]]:
    """``{name: [own microseconds, calls]}`` of a finished ``torch.profiler.profile``:
    device kernels on CUDA, operators' own host time on a CPU."""
    kind = "CUDA" if cuda else "CPU"
    return {
        e.key: [e.self_device_time_total if cuda else e.self_cpu_time_total, e.count]
        for e in prof.key_averages()
        if e.device_type.name == kind
    }


def add_times(into: dict[str, list[float]], more: dict[str, list[float]]) -> None:
    for key, (us, count) in more.items():
        acc = into.setdefault(key, [0.0, 0])
        acc[0] += us
        acc[1] += count


def kind_table(events: dict[str, list[float]], per: int, unit: str, top: int = 12) -> list[str]:
    """Lines: device time per ``unit`` (``per`` of them in ``events``) by kind, then the
    ``top`` longest kernels."""
    events = {k: v for k, v in events.items() if v[1] > 0 and v[0] > 0}
    total = sum(us for us, _ in events.values()) or 1.0
    kinds: dict[str, list[float]] = {}
    for key, (us, count) in events.items():
        acc = kinds.setdefault(kind_of(key), [0.0, 0])
        acc[0] += us
        acc[1] += count
    lines = []
    for kind, (us, count) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        lines.append(
            f"    {kind:<13} {us / per / 1e3:>8.3f} ms {us / total:>6.1%} "
            f"{count / per:>6.0f} kernels a {unit}"
        )
    for key, (us, count) in sorted(events.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"      {us / per / 1e3:>8.3f} ms {count / per:>5.0f}x {key[:90]}")
    return lines
