"""Sampled solve rate and pass@k of a maze policy on the 64 fixed maze_2d/easy eval mazes.

    python experiments/pass_at_k.py MODEL [TEMPERATURE] [K] [BORDER_PX]

Plays every eval maze K times (default 8) at TEMPERATURE (default 0.7, GRPO's), 14 px
cells, 32 turns, current frame only, and prints the mean solve rate, pass@K (the share of
mazes solved at least once), how many mazes failed all K (groups without a learning
signal for GRPO) and the share of turns by env event. BORDER_PX: the env's ``border_px``
(7 for a policy trained on framed images, ``gpu_easy.sh`` with ``BORDER=7``).
"""

import sys
import time
from collections import defaultdict

import torch

from clew.data.rows import generate_rows
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.rollout.loop import RolloutSettings, event_shares, play

torch.set_num_threads(2)
model_dir = sys.argv[1]
temperature = float(sys.argv[2]) if len(sys.argv) > 2 else 0.7
k = int(sys.argv[3]) if len(sys.argv) > 3 else 8
border_px = int(sys.argv[4]) if len(sys.argv) > 4 else 0
opts = {"cell_px": 14, "border_px": border_px, "max_turns": 32, "action_format": "keyword"}
rows = generate_rows("maze_2d/easy", 64, "eval", env_options=opts)
model, processor = load_policy(model_dir, "float32", "cpu")
engine = InferenceEngine(model, ChatFormat(processor))
sampling = SamplingParams(temperature=temperature, max_tokens=8)
started = time.time()
trajs = play(engine, rows, RolloutSettings(k, 32, 8192, sampling, 1), seed=1)
groups: dict[int, list[bool]] = defaultdict(list)
for t in trajs:
    groups[t.group_id].append(t.success)
solved = sum(sum(g) for g in groups.values()) / len(trajs)
print(
    f"T={temperature}: mean solve {solved:.3f}  pass@{k} "
    f"{sum(any(g) for g in groups.values()) / len(groups):.3f}  mazes failing all {k}: "
    f"{sum(not any(g) for g in groups.values())}  solved all {k}: "
    f"{sum(all(g) for g in groups.values())}  ({time.time() - started:.0f} s)"
)
print({name: round(v, 3) for name, v in event_shares(trajs, "turns").items()})
