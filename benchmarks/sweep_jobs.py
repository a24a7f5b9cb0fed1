"""GRPO steps a minute of a whole sweep on one machine: runs side by side against one by one.

A small policy's step is bound by the host (``recipe_steps.py``): one run leaves most of a
GPU idle. ``clew train -m --jobs N`` runs a sweep's combinations N at a time, each in a
process of its own (``clew.trainer.sweep_jobs``). This script times the same sweep, ``--runs``
runs of the recipe's GRPO phase that differ only in ``trainer.seed``, once per ``--jobs``
value, each as the command a user types (``python -m clew.cli train -m ... --jobs J``), in
one call: the first value (1 by default) is the baseline, the runs one after another in
one process.

The recipe's dataset and model stages build the policy first (random weights, as
``recipe_steps.py``: episodes run long, a step's worst case); evaluation, checkpoints and
exports are off. Printed per ``--jobs`` value: the sweep's wall seconds (start-up of every
run included), its GRPO steps a minute over all runs (``--runs x --steps`` steps in that
time), the speed-up over the first value, and the mean step of a run after its first
``--warmup`` steps (how much each run slows when it shares the device).

    python benchmarks/sweep_jobs.py --recipe recipes/easy-1gpu.yaml --runs 4 --jobs 1,2,4
    python benchmarks/sweep_jobs.py --recipe recipes/cpu-demo.yaml --device cpu --runs 2 \\
        --jobs 1,2 --steps 1 --warmup 0 --set trainer.train_batch_size=2 \\
        trainer.policy_mini_batch_size=2 generator.n_samples_per_prompt=2 generator.max_turns=2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clew.config import load_config, save_config
from clew.trainer.pipeline import run_pipeline, updated


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="recipes/easy-1gpu.yaml")
    p.add_argument("--runs", type=int, default=4, help="runs in the sweep (trainer.seed 1..N)")
    p.add_argument("--jobs", default="1,2,4", help="--jobs values timed, the first the baseline")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps of each run")
    p.add_argument("--warmup", type=int, default=3, help="steps of a run left out of its mean")
    p.add_argument("--device", default="auto")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides")
    args = p.parse_args()
    jobs = [int(j) for j in args.jobs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cfg = load_config(
            args.recipe,
            [
                f"trainer.log_path={out}",
                f"trainer.device={args.device}",
                "pipeline.stages=[dataset,model]",
                f"pipeline.dataset.train_rows={1024}",
                "trainer.eval_before_train=false",
                "trainer.eval_interval=-1",
                "trainer.ckpt_interval=-1",
                "trainer.hf_save_interval=-1",
                "trainer.export_best=false",
                "trainer.resume_mode=none",
                "trainer.logger=jsonl",
                f"trainer.max_steps={args.steps}",
                *args.set,
            ],
        )
        run_pipeline(cfg)
        cfg = updated(
            cfg,
            {
                "data.train_data": [str(out / "data" / "train.parquet")],
                "data.val_data": [],
                "trainer.policy.model.path": str(out / "models" / "base"),
            },
        )
        config = save_config(cfg, out / "sweep-config")
        seeds = ",".join(str(s) for s in range(1, args.runs + 1))
        g, t = cfg.generator, cfg.trainer
        print(
            f"{args.recipe}: {args.runs} runs of {args.steps} GRPO steps ({t.train_batch_size} "
            f"prompts x {g.n_samples_per_prompt} samples, up to {g.max_turns} turns)"
        )
        print(f"{'jobs':>4} {'wall s':>8} {'steps/min':>9} {'speed-up':>8} {'run step s':>10}")
        first = None
        for j in jobs:
            name = f"jobs{j}"
            cmd = [
                sys.executable, "-m", "clew.cli", "train", "--config", str(config.parent), "-m",
                "--jobs", str(j), f"trainer.run_name={name}", f"trainer.seed={seeds}",
            ]  # fmt: skip
            start = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - start
            if done.returncode != 0:
                sys.exit(f"--jobs {j} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
            steps = []
            for metrics in (out / name).glob("*/metrics.jsonl"):
                hist = [json.loads(line) for line in metrics.read_text().splitlines()]
                timed = [h["timing/step"] for h in hist if "timing/step" in h]
                steps += timed[args.warmup :] or timed
            rate = args.runs * args.steps * 60 / wall
            first = first or rate
            print(
                f"{j:>4} {wall:>8.1f} {rate:>9.2f} {rate / first:>7.2f}x "
                f"{statistics.mean(steps):>10.2f}"
            )


if __name__ == "__main__":
    main()
