"""A LoRA policy's rollout with the adapter unmerged beside the same with it merged.

Baseline: the adapter applied as peft runs it, each adapted projection one base matmul and
two low-rank ones (what the GRPO loop did before ``clew.train.lora.merged_for_rollouts``).
Merged: the adapter folded into the float32 base weights for the rollout and taken out
after, one matmul a projection. Both play the same maze_2d/easy rows from the same seed
(14 px cells, 32 turns, current frame only, the forced reply format, temperature 1.0), so
over float32 weights they sample the same episodes (over a bfloat16 base, the GPU's
precision for a LoRA run, the merged delta is rounded and episodes may part after a
while); prints the wall time and turns per second of each and how many episodes matched.

The adapter is given random weights (B is zero at initialisation, which would make it a
no-op); the policy is the ``--preset`` built offline with the GPU recipe's frame geometry.

    python benchmarks/lora_rollout.py [--preset tiny] [--rank 64] [--prompts 4] [--samples 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from clew.data.rows import generate_rows
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import build_model
from clew.models.precision import policy_precision
from clew.rollout.loop import RolloutSettings, play
from clew.train import PolicyWorker, WorkerSettings
from clew.train.lora import merged_for_rollouts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.preset
        build_model(
            args.preset, model_dir, arch="qwen3_vl", image_size=140, patch_size=14, merge_size=1
        )
        # the precision `clew train` gives a LoRA policy: a bfloat16 base on a GPU
        dtype, autocast = policy_precision(torch.device(args.device), "bf16-mixed", lora=True)
        settings = WorkerSettings(
            lora_rank=args.rank, lora_alpha=2.0 * args.rank, autocast_bf16=autocast
        )
        worker = PolicyWorker.from_pretrained(model_dir, settings, dtype=dtype, device=args.device)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in worker.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.02)
    cuda = args.device.startswith("cuda")
    engine = InferenceEngine(worker.model, worker.chat, autocast=autocast)
    opts = {"cell_px": 14, "border_px": 7, "max_turns": 32, "action_format": "keyword"}
    rows = generate_rows("maze_2d/easy", args.prompts, "train", env_options=opts)
    rollout = RolloutSettings(
        n_samples_per_prompt=args.samples,
        max_turns=32,
        sampling=SamplingParams(temperature=1.0, max_tokens=1),
        keep_last_k_images=1,
        reply_prefix="<action>",
        reply_suffix="</action>",
    )
    worker.model.eval()
    play(engine, rows[:1], rollout, seed=0)  # warm-up
    print(
        f"{args.prompts} x {args.samples} episodes of maze_2d/easy, preset {args.preset}, "
        f"LoRA rank {args.rank}, {dtype} base, on {args.device}"
    )
    played = {}
    for name, merge in (("adapter unmerged (baseline)", False), ("adapter merged", True)):
        t = time.perf_counter()
        if merge:
            with merged_for_rollouts(worker.model):
                trajs = play(engine, rows, rollout, seed=1)
        else:
            trajs = play(engine, rows, rollout, seed=1)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        turns = sum(x.turns for x in trajs)
        played[name] = [x.token_ids for x in trajs]
        print(f"{name:28s} {wall:7.2f} s, {turns} turns, {turns / wall:7.1f} turns/s")
    a, b = played.values()
    same = sum(x == y for x, y in zip(a, b, strict=True))
    print(f"episodes identical both ways: {same} of {len(a)}")


if __name__ == "__main__":
    main()
