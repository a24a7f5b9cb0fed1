"""How much signal a GRPO batch holds, with and without ``trainer.algorithm.turn_discount``.

    python experiments/group_spread.py MODEL [PROMPTS] [SAMPLES] [DEVICE] [BORDER_PX] [DISCOUNT] [BUDGET] [TEMPERATURE]

Plays PROMPTS training mazes of maze_2d/easy (14 px cells, 32 turns, current frame only, the
forced reply format) SAMPLES times each at TEMPERATURE (default 1.0, as a GRPO step of
``gpu_easy.sh`` does; a higher one asks how much exploration it would buy), and prints:
the solve rate; how many groups have zero spread under the env's reward, under the
discounted one (default 0.95) and under a tighter training
budget (default 26 turns: a solve that took more counts as a failure, as with
``gpu_easy.sh TRAIN_MAX_TURNS``); and, among solves, how many turns beyond the optimal
ones they took (the detours a discount penalises and the plain reward does not).
"""

import sys
from collections import Counter

import torch

from clew.algorithms.advantages import group_rewards
from clew.data.rows import generate_rows
from clew.inference.runtime import open_policy
from clew.inference.sampling import SamplingParams
from clew.rollout.filtering import learning_rewards
from clew.rollout.loop import RolloutSettings, play

model_dir = sys.argv[1]
prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 24
samples = int(sys.argv[3]) if len(sys.argv) > 3 else 8
device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
border_px = int(sys.argv[5]) if len(sys.argv) > 5 else 7
discount = float(sys.argv[6]) if len(sys.argv) > 6 else 0.95
budget = int(sys.argv[7]) if len(sys.argv) > 7 else 26
temperature = float(sys.argv[8]) if len(sys.argv) > 8 else 1.0
opts = {"cell_px": 14, "border_px": border_px, "max_turns": 32, "action_format": "keyword"}
rows = generate_rows("maze_2d/easy", prompts, "train", env_options=opts)
policy = open_policy(model_dir, None, device=device)
settings = RolloutSettings(
    n_samples_per_prompt=samples,
    max_turns=32,
    sampling=SamplingParams(temperature=temperature, max_tokens=1),
    keep_last_k_images=1,
    reply_prefix="<action>",
    reply_suffix="</action>",
)
trajs = play(policy.engine, rows, settings, seed=1)
ids = torch.tensor([t.group_id for t in trajs])
plain = group_rewards(learning_rewards(trajs), ids)
discounted = group_rewards(learning_rewards(trajs, discount), ids)
within = torch.tensor([float(t.reward > 0 and t.turns <= budget) for t in trajs])
capped = group_rewards(within, ids)
solved = [t for t in trajs if t.reward > 0]
extra = Counter(t.turns - int(rows[t.group_id].turns_needed) for t in solved)
all_solved = sum(all(t.reward > 0 for t in trajs if t.group_id == g) for g in range(len(rows)))
print(f"{len(trajs)} episodes of {prompts} mazes x {samples}, temperature {temperature}")
print(
    f"solve rate: {len(solved) / len(trajs):.1%}; groups where every sample solved: "
    f"{all_solved} of {len(rows)}"
)
print(f"zero-spread groups, env reward: {int(plain.zero_spread.sum())} of {len(rows)}")
print(f"zero-spread groups, turn_discount={discount}: {int(discounted.zero_spread.sum())}")
print(f"zero-spread groups, a {budget}-turn budget: {int(capped.zero_spread.sum())}")
print("solves by turns beyond the optimal:", dict(sorted(extra.items())))
