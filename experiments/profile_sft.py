"""Where an SFT step spends its time: cProfile of a few steps on demonstrations of MODEL.

    python experiments/profile_sft.py MODEL_DIR [DEVICE] [BATCH] [ENV_ID]

Prints the wall time per step and the functions with the most own time (host-side work
shows up here; GPU kernels show up in the synchronize calls); on CUDA also torch.profiler's
operators by device time.
"""

import cProfile
import pstats
import sys
import time

import torch

from clew.data.rows import generate_rows
from clew.train.demonstrations import demonstrations
from clew.train.worker import PolicyWorker, WorkerSettings

model_dir = sys.argv[1]
device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 16
env_id = sys.argv[4] if len(sys.argv) > 4 else "maze_2d/easy"
opts = {"cell_px": 14, "max_turns": 32, "action_format": "keyword"}
rows = generate_rows(env_id, batch, "train", env_options=opts)
worker = PolicyWorker.from_pretrained(model_dir, WorkerSettings(lr=1e-4), device=device)
t = time.perf_counter()
demos = demonstrations(rows, worker.chat, 0.0, 0)
print(f"demonstrations: {batch / (time.perf_counter() - t):.1f} per second", flush=True)
for d in demos:
    d.image_window = 1


def step() -> None:
    worker.sft_step(demos, batch)
    if device.startswith("cuda"):
        torch.cuda.synchronize()


step()
t = time.perf_counter()
for _ in range(3):
    step()
print(f"sft step (batch {batch}): {(time.perf_counter() - t) / 3:.3f} s", flush=True)
prof = cProfile.Profile()
prof.enable()
step()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)

if device.startswith("cuda"):
    # What the device spends the step on, by operator (CUDA time).
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as tp:
        step()
    print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
