"""An SFT step on packed rows beside the same step on one episode a row.

A batch of `maze_2d/easy` demonstrations (the GPU recipe's: 140 px frames, a fifth of the
turns detours, half the episodes from a random open cell, the policy seeing only its latest
frame) varies in length by a factor of two or more, and every row of a forward is as wide as
its longest episode. Baseline: one episode a row (sorted by length into micro-batches, as
``PolicyWorker`` does). clew: ``WorkerSettings(pack_sequences=True)``, short episodes laid
end to end in rows over the whole batch, ``--micro`` rows a forward
(``clew.train.model_batch.collate(pack=True)``). Prints the rows and padded
tokens each forward computes, the seconds per step of each (alternating, after one warm-up
step each) and the two losses, which must agree.

    python benchmarks/sft_packing.py [--preset tiny] [--demos 16] [--micro 16] [--repeats 2]
        [--device cpu]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from clew.data.rows import generate_rows
from clew.models import build_model
from clew.train import PolicyWorker, WorkerSettings
from clew.train.model_batch import collate
from clew.trainer.demonstrations import demonstrations

OPTIONS = {"cell_px": 14, "border_px": 7, "max_turns": 32, "action_format": "keyword"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--demos", type=int, default=16)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.preset, tmp, image_size=140, overwrite=True).path
        workers = {
            pack: PolicyWorker.from_pretrained(
                model_dir,
                WorkerSettings(lr=1e-5, pack_sequences=pack, autocast_bf16=args.device != "cpu"),
                device=args.device,
            )
            for pack in (False, True)
        }
    chat = workers[False].chat
    rows = generate_rows("maze_2d/easy", args.demos, "train", env_options=OPTIONS)
    demos = demonstrations(rows, chat, detour_prob=0.2, seed=0, start_anywhere=0.5)
    for d in demos:
        d.image_window = 1
    lengths = sorted(len(d.token_ids) for d in demos)
    print(f"{len(demos)} episodes, {sum(lengths)} tokens, {lengths[0]}-{lengths[-1]} each")
    for pack in (False, True):
        groups = workers[pack]._micro_batches(demos, range(len(demos)), args.micro, pack)
        shapes = [
            collate([demos[i] for i in idx], chat, pack=pack).input_ids.shape for idx in groups
        ]
        rows_n = sum(s[0] for s in shapes)
        cells = sum(s[0] * s[1] for s in shapes)
        print(f"{'packed' if pack else 'one a row'}: {rows_n} rows, {cells} token slots")
    seconds = {False: [], True: []}
    losses = {}
    for rep in range(args.repeats + 1):
        for pack in (False, True):
            t = time.perf_counter()
            stats = workers[pack].sft_step(demos, args.micro)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            if rep:  # the first step of each is a warm-up
                seconds[pack].append(time.perf_counter() - t)
            losses.setdefault(pack, stats["sft/loss"])
    mean = {pack: sum(s) / len(s) for pack, s in seconds.items()}
    for pack, label in ((False, "baseline, one episode a row"), (True, "clew, packed rows")):
        print(f"{label}: {mean[pack]:.3f} s a step, first loss {losses[pack]:.6f}")
    print(f"speed-up: {mean[False] / mean[True]:.2f}x")


if __name__ == "__main__":
    main()
