"""Can the vision tower alone put the agent's neighbours into the tokens at the agent's cell?

Trains only the vision tower of an untrained ``--preset`` Qwen3-VL policy (14 px patches
over 14 px cells, merge size 1) and a linear head on the tower's output at the tokens whose
patches hold part of the agent's cell, to name the open first move of ``maze_2d/easy``
dead-end starts (``first_move.py``; guessing scores 50%). Two runs from the same seed, on
the same mazes: without a border (baseline: the patch grid runs along the cells' edges, one
token is read, and the open move must come from the neighbours' tokens through attention at
fixed offsets) and with ``border_px=7`` (each of the agent's four patches holds a quarter of
the agent and of two neighbours, so the patch embedding sees them). Prints the held-out
accuracy every ``--eval-every`` steps, then both final figures.

    python benchmarks/research/vision_probe.py [--preset small] [--steps 600] [--device cpu]
    python benchmarks/research/vision_probe.py --preset tiny --steps 20 --eval-every 10 --train-rows 200 --eval-rows 40

docs/learning-easy.md quotes the `small` preset on the CPU (6,000 train rows, 350 eval
rows: 3,566 and 209 dead-end starts): without a border held-out 47.8% after 600 steps
(54.5% at step 50, 45-52% thereafter); with ``border_px=7`` 100.0% from step 50 to step 350,
where that run stopped. The port prints the same figures step for step (checked to step 100).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from first_move import (  # noqa: E402
    DeadEndStart,
    dead_end_starts,
    open_for_moves,
    patches_of,
    vision_tokens,
)

from clew.models import build_model  # noqa: E402

CELL, SIZE = 14, 9


def probe(args: argparse.Namespace, border_px: int, folder: Path) -> float:
    """Train the tower and the head with ``border_px``; the last held-out accuracy."""
    build_model(
        args.preset,
        folder,
        arch="qwen3_vl",
        image_size=SIZE * CELL + 2 * border_px,
        patch_size=CELL,
        merge_size=1,
        overwrite=True,
    )
    model, chat, _, _ = open_for_moves(str(folder), args.device)
    options = {"cell_px": CELL, "border_px": border_px, "action_format": "keyword"}
    train = dead_end_starts("maze_2d/easy", args.train_rows, "train", options)
    test = dead_end_starts("maze_2d/easy", args.eval_rows, "eval", options)
    visual = model.model.visual
    patch = model.config.vision_config.patch_size
    width = visual.config.out_hidden_size
    reads = len(patches_of(train[0].maze.start, SIZE, CELL, border_px, patch))
    head = torch.nn.Linear(width * reads, 4).to(args.device)
    params = [*visual.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    print(f"## border_px={border_px}: {len(train)} dead-end starts to train on, "
          f"{len(test)} held out; {reads} token(s) read")  # fmt: skip

    def loss_and_hits(starts: list[DeadEndStart]) -> tuple[torch.Tensor, int]:
        pixels, grid = chat.encode_frames([s.frame for s in starts])
        tokens = vision_tokens(model, pixels, grid, args.device).view(len(starts), -1, width)
        index = torch.tensor(
            [patches_of(s.maze.start, SIZE, CELL, border_px, patch) for s in starts]
        )
        features = tokens[torch.arange(len(starts))[:, None], index.to(args.device)]
        logits = head(features.flatten(1))
        target = torch.tensor([s.open_move for s in starts], device=args.device)
        return F.cross_entropy(logits, target), int((logits.argmax(-1) == target).sum())

    rng = random.Random(0)
    start, accuracy = time.time(), 0.0
    for step in range(1, args.steps + 1):
        loss, _ = loss_and_hits(rng.sample(train, min(args.batch, len(train))))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.eval_every == 0 or step == args.steps:
            with torch.no_grad():
                hits = sum(loss_and_hits(test[i : i + 50])[1] for i in range(0, len(test), 50))
            accuracy = hits / len(test)
            print(f"step {step} | {time.time() - start:.0f} s | loss {loss.item():.3f} | "
                  f"held-out {accuracy:.1%}", flush=True)  # fmt: skip
    return accuracy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--train-rows", type=int, default=6000)
    ap.add_argument("--eval-rows", type=int, default=350)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plain = probe(args, 0, Path(tmp) / "plain")
        framed = probe(args, 7, Path(tmp) / "framed")
    print(f"held-out accuracy after {args.steps} steps (chance 50%): no border "
          f"(baseline) {plain:.1%}, border_px=7 {framed:.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
