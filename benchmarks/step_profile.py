"""``profiled_phases``: one GRPO step's generate and update phases under the profilers.

While installed it wraps ``GRPOTrainer.generate`` and ``GRPOTrainer.update``; on the step it
is told to profile, each phase runs under ``torch.profiler`` (host operators, and on a GPU
its kernels) and ``cProfile`` (the Python functions), and its report goes to ``out``:

- ``<phase>.txt``: wall seconds; device-busy seconds (the kernels' summed time); kernels
  launched; host-device synchronizations and copies; the operators by own host time and,
  on a GPU, the kernels by device time; the Python functions by own and by cumulative time;
- ``<phase>.json``: the Chrome trace (``chrome://tracing``, Perfetto).

``benchmarks/recipe_steps.py --profile DIR`` installs it for the last step of its first
variant and prints the first lines of each report.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from clew.trainer.grpo import GRPOTrainer

# Host calls that wait for the device or move data between host and device.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPY_CALLS = ("cudaMemcpyAsync", "cudaMemcpy")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")


def phase_report(name: str, wall: float, prof: profile, py: cProfile.Profile, cuda: bool) -> str:
    """The text report of one profiled phase."""
    events = prof.key_averages()
    calls = {e.key: e.count for e in events}
    lines = [f"{name}: {wall:.3f} s wall"]
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1e6
        lines.append(f"  device busy {busy:.3f} s ({busy / wall:.0%}), {len(kernels)} kernels")
    for label, names in (("launches", LAUNCH_CALLS), ("syncs", SYNC_CALLS), ("copies", COPY_CALLS)):
        lines.append(f"  {label}: " + ", ".join(f"{n} {calls.get(n, 0)}" for n in names))
    lines.append("\nOperators by own host time:")
    lines.append(
        events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    )
    if cuda:
        lines.append("Kernels by device time:")
        lines.append(
            events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60)
        )
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(py, stream=text).sort_stats(order).print_stats(70)
        lines.append(f"Python functions by {order}:\n" + text.getvalue())
    return "\n".join(lines)


@contextmanager
def profiled_phases(out: Path, step: int) -> Iterator[list[str]]:
    """``GRPOTrainer``'s generate and update profiled on global step ``step``; yields the list
    the reports' first lines are appended to as they are written."""
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    heads: list[str] = []
    originals = {n: getattr(GRPOTrainer, n) for n in ("generate", "update")}

    def wrap(name: str):
        original = originals[name]

        def run(self, *args, **kwargs):
            if self.state.global_step != step:
                return original(self, *args, **kwargs)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            if cuda:
                torch.cuda.synchronize()
            py = cProfile.Profile()
            with profile(activities=activities) as prof:
                started = time.perf_counter()
                py.enable()
                result = original(self, *args, **kwargs)
                py.disable()
                if cuda:
                    torch.cuda.synchronize()
                wall = time.perf_counter() - started
            report = phase_report(name, wall, prof, py, cuda)
            (out / f"{name}.txt").write_text(report)
            prof.export_chrome_trace(str(out / f"{name}.json"))
            heads.extend(report.splitlines()[: 5 if cuda else 4])
            return result

        return run

    for name in originals:
        setattr(GRPOTrainer, name, wrap(name))
    try:
        yield heads
    finally:
        for name, fn in originals.items():
            setattr(GRPOTrainer, name, fn)
