"""Where an SFT step spends its time: host batches, device steps, and cProfile of one step.

    python experiments/profile_sft.py MODEL_DIR [DEVICE] [BATCH] [ENV_ID]

Settings of the GPU recipe come from the environment (defaults in brackets): BORDER [0],
CELL_PX [14], MICRO [BATCH], KEEP [1], AUTOCAST [0] (1: bfloat16 autocast, the recipe's
bf16-mixed), DETOUR [0.0], ANYWHERE [0.0]. Prints the seconds to play one batch of
demonstrations on the host (what `clew sft` does on a thread, one batch ahead), the seconds
of one SFT step on those batches, and the functions with the most own time (host-side work
shows up here; GPU kernels in the synchronize calls); on CUDA also torch.profiler's
operators by device time.
"""

import cProfile
import os
import pstats
import sys
import time

import torch

from clew.data.rows import generate_rows
from clew.train.demonstrations import demonstration_batches
from clew.train.worker import PolicyWorker, WorkerSettings

model_dir = sys.argv[1]
device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 16
env_id = sys.argv[4] if len(sys.argv) > 4 else "maze_2d/easy"
micro = int(os.environ.get("MICRO", batch))
opts = {
    "cell_px": int(os.environ.get("CELL_PX", 14)),
    "border_px": int(os.environ.get("BORDER", 0)),
    "max_turns": 32,
    "action_format": "keyword",
}
rows = generate_rows(env_id, batch * 4, "train", env_options=opts)
settings = WorkerSettings(lr=1e-4, autocast_bf16=os.environ.get("AUTOCAST", "0") == "1")
worker = PolicyWorker.from_pretrained(model_dir, settings, device=device)
batches = demonstration_batches(
    rows,
    worker.chat,
    batch,
    float(os.environ.get("DETOUR", 0.0)),
    0,
    int(os.environ.get("KEEP", 1)),
    float(os.environ.get("ANYWHERE", 0.0)),
)
t = time.perf_counter()
played = [next(batches) for _ in range(4)]
print(
    f"host: one batch of {batch} demonstrations in {(time.perf_counter() - t) / 4:.3f} s",
    flush=True,
)
tokens = sum(len(d.token_ids) for d in played[0])
print(
    f"tokens in a batch: {tokens} (longest {max(len(d.token_ids) for d in played[0])})", flush=True
)


def step(i: int) -> None:
    worker.sft_step(played[i % 4], micro)
    if device.startswith("cuda"):
        torch.cuda.synchronize()


step(0)
t = time.perf_counter()
for i in range(1, 4):
    step(i)
print(f"sft step (batch {batch}, micro {micro}): {(time.perf_counter() - t) / 3:.3f} s", flush=True)
prof = cProfile.Profile()
prof.enable()
step(1)
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)

if device.startswith("cuda"):
    # What the device spends the step on, by operator (CUDA time).
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as tp:
        step(2)
    print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=30), flush=True)
