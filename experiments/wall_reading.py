"""Can a policy architecture learn to read the walls next to it? A supervised first-move test.

    python experiments/wall_reading.py MODEL [MINUTES] [DEVICE] [BATCH] [LR]

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
architectures can be compared before a whole SFT run is spent on one.
"""

from __future__ import annotations

import random
import sys
import time

import torch
import torch.nn.functional as F

from clew.data.rows import generate_rows
from clew.envs import make
from clew.envs.maze.actions import Action, format_action
from clew.envs.maze.generate import DIRECTIONS
from clew.inference.runtime import limit_host_threads
from clew.inference.sampling import banned_token_ids, mask_banned
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.train.agreement import decision_tokens
from clew.train.batch import collate
from clew.train.sft import Demonstration
from clew.train.worker import logits_at

model_dir = sys.argv[1]
minutes = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
batch_size = int(sys.argv[4]) if len(sys.argv) > 4 else 32
lr = float(sys.argv[5]) if len(sys.argv) > 5 else 1e-3
limit_host_threads(torch.device(device))
torch.manual_seed(0)
model, processor = load_policy(model_dir, "float32", device)
model.train()
chat = ChatFormat(processor)
decision = decision_tokens(chat, "keyword")
if decision is None:
    sys.exit("the keyword action format has no single decision token with this tokenizer")
offset, action_of = decision
token_of = {text: token for token, text in action_of.items()}
banned = banned_token_ids(chat).to(device)
words = [format_action(Action("move", d), "keyword") for d in range(len(DIRECTIONS))]
options = {"cell_px": 14, "max_turns": 32, "action_format": "keyword"}


def dead_end_starts(split: str, n: int) -> list:
    """(prompt text, first frame, the one open direction) of the dead-end starts in n rows."""
    out = []
    for row in generate_rows("maze_2d/easy", n, split, env_options=options):
        env = make(row.env_id, **row.options())
        obs = env.reset(int(row.seed))
        maze, (r, c) = env.maze, env.maze.start
        inner = [
            d
            for d, (dr, dc) in enumerate(DIRECTIONS)
            if 0 < r + dr < maze.size - 1 and 0 < c + dc < maze.size - 1
        ]
        opened = [d for d in inner if maze.is_open((r + DIRECTIONS[d][0], c + DIRECTIONS[d][1]))]
        if len(opened) == 1:
            out.append((obs.text, obs.images[0], opened[0]))
    return out


def batch_of(items: list) -> tuple:
    demos, at = [], []
    for text, image, d in items:
        chunk = chat.user_turn(text, [image], first=True, after_reply_end=True, pixels=False)
        reply = chat.reply_tokens(words[d])
        n = len(chunk.token_ids)
        demo = Demonstration(
            list(chunk.token_ids) + list(reply), [0] * n + [1] * len(reply), [image]
        )
        demo.chunk_starts, demo.image_window = [0], 1
        demos.append(demo)
        at.append(n + offset - 1)
    batch = collate(demos, chat)
    keep = torch.zeros(batch.input_ids.shape, dtype=torch.bool, device=device)
    keep[torch.arange(len(at)), torch.tensor(at)] = True
    target = torch.tensor([token_of[words[d]] for _, _, d in items], device=device)
    return batch, keep, target


def accuracy(items: list) -> float:
    model.eval()
    hits = 0
    with torch.no_grad():
        for i in range(0, len(items), 50):
            batch, keep, target = batch_of(items[i : i + 50])
            logits = mask_banned(logits_at(model, batch, keep, torch.float32).float(), banned)
            hits += int((logits.argmax(-1) == target).sum())
    model.train()
    return hits / len(items)


train, test = dead_end_starts("train", 20000), dead_end_starts("eval", 350)
print(f"dead-end starts: {len(train)} to train on, {len(test)} held out", flush=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
rng = random.Random(0)
start, step, passed = time.time(), 0, None
while time.time() - start < minutes * 60:
    batch, keep, target = batch_of(rng.sample(train, batch_size))
    logits = mask_banned(logits_at(model, batch, keep, torch.float32).float(), banned)
    loss = F.cross_entropy(logits, target)
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
