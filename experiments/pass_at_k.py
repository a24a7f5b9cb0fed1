"""Sampled solve rate and pass@k of a maze policy on the 64 fixed maze_2d/easy eval mazes.

    python experiments/pass_at_k.py MODEL [TEMPERATURE] [K] [BORDER_PX] [FORCED] [ALLOWED]

Plays every eval maze K times (default 8) at TEMPERATURE (default 0.7, GRPO's), 14 px
cells, 32 turns, current frame only, and prints the mean solve rate, pass@K (the share of
mazes solved at least once), how many mazes failed all K (groups without a learning
signal for GRPO) and the share of turns by env event. BORDER_PX: the env's ``border_px``
(7 for a policy trained on framed images, ``gpu_easy.sh`` with ``BORDER=7``). FORCED=1: the
forced reply frame (``<action>`` + one sampled token + ``</action>``, ``gpu_easy.sh FORCED=1``);
ALLOWED: comma-separated ``allowed_tokens`` (e.g. up,down,left,right,stop), sampled as GRPO
with ``generator.sampling_params.allowed_tokens`` samples. With FORCED it also plays the mazes
greedily and prints how many of the mazes greedy play fails are solved by some sample: the
exploration GRPO has left on the mazes it still fails.
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
forced = len(sys.argv) > 5 and sys.argv[5] == "1"
allowed = tuple(w for w in sys.argv[6].split(",") if w) if len(sys.argv) > 6 else ()
opts = {"cell_px": 14, "border_px": border_px, "max_turns": 32, "action_format": "keyword"}
rows = generate_rows("maze_2d/easy", 64, "eval", env_options=opts)
model, processor = load_policy(model_dir, "float32", "cpu")
engine = InferenceEngine(model, ChatFormat(processor))
frame = {"reply_prefix": "<action>", "reply_suffix": "</action>"} if forced else {}
sampling = SamplingParams(
    temperature=temperature, max_tokens=1 if forced else 8, allowed_tokens=allowed
)
started = time.time()
trajs = play(engine, rows, RolloutSettings(k, 32, 8192, sampling, 1, **frame), seed=1)
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
if forced:
    greedy = play(
        engine, rows, RolloutSettings(1, 32, 8192, SamplingParams(0.0, max_tokens=1), 1, **frame)
    )
    failed = [t.group_id for t in greedy if not t.success]
    rescued = sum(any(groups[g]) for g in failed)
    print(
        f"greedy pass@1 {1 - len(failed) / len(greedy):.3f}; of its {len(failed)} failed mazes "
        f"{rescued} are solved by some sample, the solve rate there {sum(sum(groups[g]) for g in failed) / max(1, k * len(failed)):.3f}"
    )
