"""Can a policy architecture learn to read the walls next to it? A supervised first-move test.

    python experiments/wall_reading.py MODEL [MINUTES] [DEVICE] [BATCH] [LR] [ENV_ID]

MODEL is an untrained policy directory (``clew init-model ... --image-size 126 --patch-size 14
--merge-size 1``, with any ``--text`` / ``--vision`` fields). The test trains it on one thing:
the first move of ``maze_2d/easy`` mazes (14 px cells) whose start corner is a dead end, so
the one open move is forced and the goal's direction does not give it away (both inner
neighbours of a corner lie towards the goal). Guessing scores 50%; only a model that reads
the two cells next to the agent scores higher. It prints the training loss and the accuracy
on 200 held-out eval mazes' dead-end starts as it trains, and the steps it took to pass 90%.

Why: every policy SFT'd for the GPU recipe so far (1,600 steps, three vision depths) and the
GRPO policy after 185 steps choose their first move regardless of those two cells
(``experiments/wall_probe.py``); this test measures that one skill in minutes, so candidate
architectures can be compared before a whole SFT run is spent on one. ENV_ID (default
maze_2d/easy) takes a smaller maze (maze_2d/small: fewer cells to search the frame for, 100 held-out
rows; build MODEL with ``--image-size 98``).

Measured (BENCHMARKS.md, "Seventh attempt" and "Eighth attempt"): every model tried stays at
chance, on the CPU and for 2,200-2,400 GPU steps of 64, with or without ``BORDER=7``; one bit
a sample through the whole model is too little signal. SFT on whole episodes did learn it
with the border (``wall_probe.py``), and ``vision_probe.py`` isolates the vision tower.
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from _first_move import MOVE_WORDS, dead_end_starts, first_move_batch, open_for_moves

from clew.inference.sampling import banned_token_ids, mask_banned
from clew.train.worker import logits_at

model_dir = sys.argv[1]
minutes = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
batch_size = int(sys.argv[4]) if len(sys.argv) > 4 else 32
lr = float(sys.argv[5]) if len(sys.argv) > 5 else 1e-3
env_id = sys.argv[6] if len(sys.argv) > 6 else "maze_2d/easy"
model, chat, offset, action_of = open_for_moves(model_dir, device)
model.train()
token_of = {text: token for token, text in action_of.items()}
banned = banned_token_ids(chat).to(device)
words = MOVE_WORDS
# BORDER=7 draws the env's wall-gray border of 7 px (half a cell) around every frame, so the
# patch grid (14 px) falls across the cells' centres instead of along their edges (build
# MODEL with --image-size 140).
options = {
    "cell_px": 14,
    "border_px": int(os.environ.get("BORDER", "0")),
    "action_format": "keyword",
}


def loss_and_logits(starts: list) -> tuple[torch.Tensor, torch.Tensor]:
    turns = [(s.text, s.frame, words[s.open_move]) for s in starts]
    batch, keep = first_move_batch(chat, offset, turns, device)
    logits = mask_banned(logits_at(model, batch, keep, torch.float32).float(), banned)
    target = torch.tensor([token_of[words[s.open_move]] for s in starts], device=device)
    return F.cross_entropy(logits, target), (logits.argmax(-1) == target)


def accuracy(starts: list) -> float:
    model.eval()
    with torch.no_grad():
        hits = sum(
            int(loss_and_logits(starts[i : i + 50])[1].sum()) for i in range(0, len(starts), 50)
        )
    model.train()
    return hits / len(starts)


# maze_2d/small has only about 120 eval-split layouts (clew.data.rows splits by layout)
test_rows = 350 if env_id == "maze_2d/easy" else 100
train = dead_end_starts(env_id, 20000, "train", options)
test = dead_end_starts(env_id, test_rows, "eval", options)
print(f"dead-end starts: {len(train)} to train on, {len(test)} held out", flush=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
rng = random.Random(0)
start, step, passed = time.time(), 0, None
while time.time() - start < minutes * 60:
    loss, _ = loss_and_logits(rng.sample(train, batch_size))
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    step += 1
    if step % 50 == 0:
        acc = accuracy(test)
        if passed is None and acc >= 0.9:
            passed = step
        print(
            f"step {step} | {time.time() - start:.0f} s | loss {loss.item():.3f} | held-out {acc:.1%}",
            flush=True,
        )
print(
    f"done: {step} steps of {batch_size}; held-out accuracy {accuracy(test):.1%}; "
    f"passed 90% at step {passed if passed is not None else 'never'}"
)
