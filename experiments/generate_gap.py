"""Does `clew train`'s generate phase cost more than a bare `play()`? Same policy, rows, settings.

    python experiments/generate_gap.py MODEL_DIR [DEVICE] [PROMPTS] [SAMPLES]

Builds the worker group exactly as `clew train` does (``clew.run.build_worker_group``) and,
beside it, a plain engine on ``load_policy``; plays the same maze_2d/easy rows with each,
twice, alternating, and prints the wall time of each. Session 6 saw the trainer's phase
take about twice what ``experiments/profile_rollout.py`` measures on the GPU.
"""

import time

import _recipe
import torch

from clew.config import load_config
from clew.inference.engine import InferenceEngine
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.rollout.loop import play
from clew.run import build_worker_group

model_dir, device, prompts, samples = _recipe.args(3, 4)
rows = _recipe.rows(prompts)
cfg = load_config(
    None,
    [
        f"trainer.policy.model.path={model_dir}",
        f"trainer.device={device}",
        f"generator.n_samples_per_prompt={samples}",
        f"trainer.train_batch_size={prompts}",
        f"trainer.policy_mini_batch_size={prompts}",
        f"trainer.micro_train_batch_size_per_gpu={samples}",
        f"trainer.micro_forward_batch_size_per_gpu={samples}",
    ],
)
group = build_worker_group(cfg, 100)
settings = _recipe.settings(samples)
model, processor = load_policy(model_dir, "float32", device)
engine = InferenceEngine(model, ChatFormat(processor), autocast=device.startswith("cuda"))
runs = {
    "play() on load_policy": lambda: play(engine, rows, settings, seed=5),
    "the trainer's worker group": lambda: group.generate(rows, settings, seed=5),
}
for _ in range(2):
    for name, fn in runs.items():
        t = time.perf_counter()
        trajs = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        turns = sum(x.turns for x in trajs)
        print(f"{name:28s} {dt:6.2f} s  {turns} turns  {turns / dt:.0f} turns/s", flush=True)
