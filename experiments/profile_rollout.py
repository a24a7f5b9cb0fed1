"""Where GRPO's generate phase spends its time: cProfile of one batch of maze episodes.

    python experiments/profile_rollout.py MODEL_DIR [DEVICE] [PROMPTS] [SAMPLES] [SORT]

Plays PROMPTS (default 24) maze_2d/easy rows x SAMPLES (default 8) episodes with the GPU
recipe's settings (14 px cells, 32 turns, current frame only, temperature 0.7, up to 8
tokens a reply), once to warm up, twice timed (the plain figure) and once under cProfile;
prints the wall times, turns per second and the functions with the most own time (SORT:
a pstats key, default ``tottime``). On CUDA (unless TORCH_PROFILE=0) it then plays the batch again
under torch.profiler and prints the operators by device time: if the device total is far
below the wall time, the host (env, tokens, positions, Python around the model) is what
to speed up.
"""

import cProfile
import os
import pstats
import sys
import time

import _recipe
import torch

from clew.inference.engine import InferenceEngine
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.rollout.loop import play

model_dir, device, prompts, samples = _recipe.args(24, 8)
rows = _recipe.rows(prompts)
model, processor = load_policy(model_dir, "float32", device)
engine = InferenceEngine(model, ChatFormat(processor), autocast=device.startswith("cuda"))
settings = _recipe.settings(samples)


def batch() -> int:
    trajs = play(engine, rows, settings, seed=0)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return sum(len(t.actions) for t in trajs)


batch()
t = time.perf_counter()
turns = batch() + batch()
wall = (time.perf_counter() - t) / 2
print(
    f"{prompts} x {samples} episodes, plain: {wall:.2f} s a batch, {turns / 2 / wall:.0f} turns/s"
)
prof = cProfile.Profile()
t = time.perf_counter()
prof.enable()
turns = batch()
prof.disable()
wall = time.perf_counter() - t
print(
    f"{prompts} x {samples} episodes, under cProfile: {wall:.2f} s, {turns} turns, {turns / wall:.0f} turns/s"
)
pstats.Stats(prof).sort_stats(sys.argv[5] if len(sys.argv) > 5 else "tottime").print_stats(25)
if device.startswith("cuda") and os.environ.get("TORCH_PROFILE", "1") != "0":
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as tp:
        batch()
    print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
