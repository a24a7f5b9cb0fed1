"""Can the vision tower alone put the agent's neighbours into the tokens at the agent's cell?

    python experiments/vision_probe.py MODEL [MINUTES] [BORDER_PX] [LR] [DEVICE]

MODEL is a policy directory built with 14 px patches and merge size 1 (``clew init-model
... --image-size 126 --patch-size 14 --merge-size 1``, or 140 with BORDER_PX=7). The probe
trains only the vision tower and a linear head on the tower's output at the tokens whose
patches hold part of the agent's cell (one token without a border; four with a half-cell
border), to name the open first move of ``maze_2d/easy`` dead-end starts (see
``_first_move.py``; guessing scores 50%). It prints the held-out accuracy as it trains.

Why: ``wall_reading.py`` found no policy that learns that move through the whole model, and
``wall_probe.py`` found the trained towers keep each cell's token to itself. This isolates the
tower: without a border the open move must come from the neighbours' tokens through
attention at fixed offsets; with the half-cell border each of the agent's four patches
holds a quarter of the agent and of two neighbours, so the patch embedding sees them.
"""

from __future__ import annotations

import random
import sys
import time

import torch
import torch.nn.functional as F
from _first_move import MOVE_WORDS, dead_end_starts, first_move_batch, open_for_moves, patches_of

model_dir = sys.argv[1]
minutes = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
border_px = int(sys.argv[3]) if len(sys.argv) > 3 else 0
lr = float(sys.argv[4]) if len(sys.argv) > 4 else 1e-3
device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
model, chat, offset, _ = open_for_moves(model_dir, device)
options = {"cell_px": 14, "border_px": border_px, "action_format": "keyword"}
patch = model.config.vision_config.patch_size

train = dead_end_starts("maze_2d/easy", 6000, "train", options)
test = dead_end_starts("maze_2d/easy", 350, "eval", options)
visual = model.model.visual
at = patches_of(train[0].maze.start, train[0].maze.size, 14, border_px, patch)
head = torch.nn.Linear(visual.config.out_hidden_size * len(at), 4).to(device)
optimizer = torch.optim.AdamW([*visual.parameters(), *head.parameters()], lr=lr, weight_decay=0.0)
print(f"dead-end starts: {len(train)} to train on, {len(test)} held out; {len(at)} token(s) read")


def loss_and_hits(starts: list) -> tuple[torch.Tensor, int]:
    turns = [(s.text, s.frame, MOVE_WORDS[s.open_move]) for s in starts]
    batch, _ = first_move_batch(chat, offset, turns, device)
    tokens = visual(batch.pixel_values.patches(device), grid_thw=batch.image_grid_thw.to(device))
    per_image = tokens.pooler_output.view(len(starts), -1, visual.config.out_hidden_size)
    index = torch.tensor(
        [patches_of(s.maze.start, s.maze.size, 14, border_px, patch) for s in starts]
    )
    features = per_image[torch.arange(len(starts))[:, None], index.to(device)].flatten(1)
    logits = head(features)
    target = torch.tensor([s.open_move for s in starts], device=device)
    return F.cross_entropy(logits, target), int((logits.argmax(-1) == target).sum())


rng = random.Random(0)
start, step = time.time(), 0
while time.time() - start < minutes * 60:
    loss, _ = loss_and_hits(rng.sample(train, 32))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    if step % 50 == 0:
        with torch.no_grad():
            hits = sum(loss_and_hits(test[i : i + 50])[1] for i in range(0, len(test), 50))
        print(
            f"step {step} | {time.time() - start:.0f} s | loss {loss.item():.3f} | "
            f"held-out {hits / len(test):.1%}",
            flush=True,
        )
