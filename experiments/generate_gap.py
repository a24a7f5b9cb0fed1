"""Does `clew train`'s generate phase cost more than a bare `play()`? Same policy, rows, settings.

    python experiments/generate_gap.py MODEL_DIR [DEVICE] [PROMPTS] [SAMPLES] [--after-update]

Builds the worker group exactly as `clew train` does (``clew.run.build_worker_group``) and,
beside it, a plain engine on ``load_policy``; plays the same maze_2d/easy rows with each,
twice, alternating, and prints the wall time of each (``FORCED=1`` / ``TEMPERATURE`` in
the environment pick the rollout settings, ``experiments/_recipe.py``). Session 6 saw the
trainer's phase take about twice what ``experiments/profile_rollout.py`` measures on the
GPU; session 7 found the two equal back to back, while the trainer's batches still took
twice as long. ``--after-update`` then runs what a training step puts between two
generate phases, the worker group's GRPO update on the batch it played (the GPU recipe's
mini-batch of half the prompts, micro-batches of ``MICRO`` trajectories, default
SAMPLES), and times the worker group's generate again after each of two updates.
Session 8 on the GPU: an update changes nothing; the gap is the seed. The back-to-back
figures replay the episodes of one seed (1.84 s a batch of 24 x 8), every batch of a new
seed costs about twice that (4.1-5.1 s), as the trainer's steps do.
"""

import os
import sys
import time

import _recipe
import torch

from clew.algorithms.advantages import compute_advantages
from clew.config import load_config
from clew.inference.engine import InferenceEngine
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.rollout.loop import play
from clew.run import build_worker_group

after_update = "--after-update" in sys.argv
if after_update:
    sys.argv.remove("--after-update")
model_dir, device, prompts, samples = _recipe.args(3, 4)
micro = int(os.environ.get("MICRO", samples))
rows = _recipe.rows(prompts)
cfg = load_config(
    None,
    [
        f"trainer.policy.model.path={model_dir}",
        f"trainer.device={device}",
        f"generator.n_samples_per_prompt={samples}",
        f"trainer.train_batch_size={prompts}",
        f"trainer.policy_mini_batch_size={max(prompts // 2, 1)}",
        f"trainer.micro_train_batch_size_per_gpu={micro}",
        f"trainer.micro_forward_batch_size_per_gpu={micro}",
        "trainer.policy.optimizer_config.lr=2e-4",
        "trainer.algorithm.loss_reduction=sequence_mean",
    ],
)
group = build_worker_group(cfg, 100)
settings = _recipe.settings(samples)
sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None


def timed(name: str, fn):
    t = time.perf_counter()
    trajs = fn()
    sync()
    dt = time.perf_counter() - t
    turns = sum(x.turns for x in trajs)
    print(f"{name:34s} {dt:6.2f} s  {turns} turns  {turns / dt:.0f} turns/s", flush=True)
    return trajs


if not after_update:
    model, processor = load_policy(model_dir, "float32", device)
    engine = InferenceEngine(model, ChatFormat(processor), autocast=device.startswith("cuda"))
    runs = {
        "play() on load_policy": lambda: play(engine, rows, settings, seed=5),
        "the trainer's worker group": lambda: group.generate(rows, settings, seed=5),
    }
    for _ in range(2):
        for name, fn in runs.items():
            timed(name, fn)
else:
    trajs = timed("worker group, cold", lambda: group.generate(rows, settings, seed=5))
    trajs = timed("worker group, warm", lambda: group.generate(rows, settings, seed=6))
    for step in (1, 2):
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        ids = torch.tensor([t.group_id for t in trajs])
        adv = compute_advantages("grpo", rewards, ids).advantages
        t = time.perf_counter()
        stats = group.update(trajs, adv, cfg)
        sync()
        print(f"update {step}: {time.perf_counter() - t:.2f} s, {len(stats)} stats", flush=True)
        trajs = timed(
            f"worker group after update {step}",
            lambda s=step: group.generate(rows, settings, seed=6 + s),
        )
