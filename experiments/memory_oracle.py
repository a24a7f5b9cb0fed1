"""How much a perfect memory of where the agent has been would lift a maze policy.

    python experiments/memory_oracle.py MODEL EVAL_PARQUET [MEMORY] [KEEP]

Plays every maze of EVAL_PARQUET (a ``clew dataset --split eval`` file) greedily with the
policy in MODEL, on the CPU, as ``clew eval`` does with the forced reply format
(``<action>`` + one word + ``</action>``) and KEEP frames (default 1). With MEMORY=1 each
turn's action is the policy's most likely one that the agent has not yet played *from this
cell*, so a walk never repeats a (cell, move) pair: a depth-first search led by the
policy's preferences, the most that remembering its past (more frames, a visited-cell
trace) could buy a policy that keeps its choices. MEMORY=0 is plain greedy play (it
reproduces ``clew eval``'s pass@1: 56 of 64 for ``grpo-lora-s19``).

Prints the solve count and, for each failed maze, its optimal length, how the episode ended
and the walk as distance changes (``-`` one cell closer to the goal, ``+`` farther, ``0`` a
wall bump): long ``+`` runs are wrong branches walked to their dead end.

The engine (``clew.inference``) samples with a KV cache and has no hook to skip an action
per sequence; this script instead re-runs each episode so far as one teacher-forced forward
a turn (``clew.train.agreement``'s decision token), about 8 minutes for 64 mazes on 2 cores.
"""

import sys

import torch

from clew.data.rows import read_rows
from clew.envs import make
from clew.envs.maze.actions import Action, format_action
from clew.envs.maze.solver import distances_to
from clew.inference.sampling import banned_token_ids, mask_banned
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.train.agreement import decision_tokens
from clew.train.batch import collate
from clew.train.demonstrations import Demonstration
from clew.train.worker import logits_at

model_dir, data = sys.argv[1], sys.argv[2]
memory = len(sys.argv) > 3 and sys.argv[3] == "1"
keep = int(sys.argv[4]) if len(sys.argv) > 4 else 1
rows = read_rows(data)
model, processor = load_policy(model_dir, "float32", "cpu")
model.eval()
chat = ChatFormat(processor)
found = decision_tokens(chat, "keyword")
if found is None:
    sys.exit("the keyword action format has no single decision token for this tokenizer")
offset, action_of = found
banned = banned_token_ids(chat)
placeholder = chat.reply_tokens(format_action(Action("stop"), "keyword"))

episodes = []
for row in rows:
    env = make(row.env_id, **row.options())
    obs = env.reset(int(row.seed))
    dist = distances_to(env.maze, env.maze.goal)
    episodes.append(
        {
            "env": env,
            "obs": obs,
            "dist": dist,
            "optimal": env.optimal_path_length(),
            "demo": Demonstration([], [], [], image_window=keep),
            "tried": set(),
            "walk": "",
            "end": None,
            "success": False,
        }
    )

turn = 0
while any(e["end"] is None for e in episodes):
    live = [e for e in episodes if e["end"] is None]
    queries, starts = [], []
    for e in live:
        d = e["demo"]
        chunk = chat.user_turn(
            e["obs"].text, e["obs"].images, first=turn == 0, after_reply_end=True, pixels=False
        )
        d.chunk_starts.append(len(d.token_ids))
        d.token_ids += chunk.token_ids
        d.loss_mask += [0] * len(chunk.token_ids)
        d.images += e["obs"].images
        starts.append(len(d.token_ids))
        queries.append(
            Demonstration(
                d.token_ids + placeholder,
                d.loss_mask + [1] * len(placeholder),
                list(d.images),
                chunk_starts=list(d.chunk_starts),
                image_window=keep,
            )
        )
    with torch.no_grad():
        batch = collate(queries, chat)
        at = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
        for b, s in enumerate(starts):
            at[b, s + offset - 1] = True  # logits at t predict token t + 1
        logp = torch.log_softmax(
            mask_banned(logits_at(model, batch, at, torch.float32), banned), -1
        )
    for e, lp in zip(live, logp, strict=True):
        ranked = [action_of[t] for t in lp.argsort(descending=True).tolist() if t in action_of]
        cell = e["env"].agent
        choice = ranked[0]
        if memory:
            choice = next((a for a in ranked if (cell, a) not in e["tried"]), ranked[0])
            e["tried"].add((cell, choice))
        reply = chat.reply_tokens(choice)
        e["demo"].token_ids += reply
        e["demo"].loss_mask += [1] * len(reply)
        before = int(e["dist"][cell])
        obs, reward, done, info = e["env"].step(choice)
        after = int(e["dist"][e["env"].agent])
        e["walk"] += "0" if after == before and "stop" not in choice else "-+"[after > before]
        e["obs"] = obs
        if done:
            e["end"], e["success"] = info["done_reason"], reward > 0
    turn += 1

solved = sum(e["success"] for e in episodes)
print(f"memory={int(memory)} keep={keep}: solved {solved} of {len(episodes)} mazes")
for row, e in zip(rows, episodes, strict=True):
    if not e["success"]:
        print(
            f"  seed {row.seed}: optimal {e['optimal']} moves, ended by {e['end']} after "
            f"{len(e['walk'])} turns, {e['walk']}"
        )
