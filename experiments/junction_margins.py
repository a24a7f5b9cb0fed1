"""How close a maze policy's wrong greedy choices were: the probability it gave an optimal move
at every turn of its own greedy episodes.

    python experiments/junction_margins.py MODEL TRAJECTORIES [DEVICE]

TRAJECTORIES: ``clew eval``'s trajectories.jsonl of MODEL's greedy play (forced reply frame,
``--keep-last-k-images 1``, as BENCHMARKS.md's CPU evaluations run it). Each episode's
actions are replayed as a DAgger prefix (``clew.train.demonstrations.play_demonstration``),
so every turn's context is the one greedy play saw, and one forward pass per batch reads the
distribution over the five action words at each turn's decision token (other tokens
masked, as ``generator.sampling_params.allowed_tokens`` samples). A check: the most likely
word must be the action greedy play took, or the replay is not the play.

Prints, for the turns off the goal by kind (junction on a first visit, all turns), where the
greedy move was not optimal, how much probability the optimal moves had (in bins): a wrong
choice with 0.3-0.5 on the right way is a close call that sharper training flips; one with
under 0.05 is a confident error that sampling rarely explores. Then the wrong first-visit
junction moves by where they went (an open side branch, a wall, stop: a misread frame or a
misplanned route), and for each failed episode the first such junction's figure. Run on a
GRPO start and on a GRPO policy from it, it shows which kind of wrong choice GRPO turned
into a right one and which it left (BENCHMARKS.md, "Thirty-second attempt").
"""

from __future__ import annotations

import json
import random
import sys
from collections import defaultdict
from pathlib import Path

import torch

from clew.data.rows import MazeRow
from clew.envs import make
from clew.envs.maze.actions import parse_action
from clew.envs.maze.generate import DIRECTIONS
from clew.envs.maze.solver import distances_to
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.train.agreement import decision_tokens
from clew.train.batch import collate
from clew.train.demonstrations import play_demonstration
from clew.train.worker import logits_at

BINS = (0.0, 0.05, 0.15, 0.3, 0.5, 1.01)

model_dir, traj_path = sys.argv[1], Path(sys.argv[2])
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
episodes = [json.loads(line) for line in traj_path.read_text().splitlines()]
model, processor = load_policy(model_dir, "float32", device)
model.eval()
chat = ChatFormat(processor)


def row_of(ep: dict) -> MazeRow:
    options = ep["env_options"]
    env = make(ep["env_id"], **options)
    env.reset(int(ep["seed"]))
    needed = env.turns_needed()
    return MazeRow(
        ep["env_id"], json.dumps(options), int(ep["seed"]), "eval", "", needed - 1, needed,
        env.max_turns, needed <= env.max_turns, "",
    )  # fmt: skip


def turn_facts(ep: dict) -> list[tuple[str, set[int], set[int], bool]]:
    """Per turn: the cell's kind (first visit or revisit), its optimal and its open directions,
    and whether the agent is on the goal."""
    env = make(ep["env_id"], **ep["env_options"])
    env.reset(int(ep["seed"]))
    dist = distances_to(env.maze, env.maze.goal)
    seen: set = set()
    out = []
    for action in ep["actions"]:
        here = env.agent
        good, opened = set(), set()
        for d, (dr, dc) in enumerate(DIRECTIONS):
            cell = (here[0] + dr, here[1] + dc)
            if env.maze.is_open(cell):
                opened.add(d)
                if dist[cell] == dist[here] - 1:
                    good.add(d)
        kind = {1: "dead end", 2: "corridor"}.get(len(opened), "junction")
        visit = "first visit" if here not in seen else "revisit"
        seen.add(here)
        out.append((f"{kind}, {visit}", good, opened, here == env.maze.goal))
        env.step(action)
    return out


offset, word_of = decision_tokens(chat, "keyword")
ids = torch.tensor(sorted(word_of), device=device)
names = [word_of[int(i)] for i in ids]  # the replies, e.g. <action>up</action>
# Which reply is which direction index / stop, by the env's own parser.
probe = make(episodes[0]["env_id"], **episodes[0]["env_options"])
kinds_of = []
for text in names:
    action = parse_action(text, probe.action_format)
    kinds_of.append("stop" if action.kind == "stop" else action.direction)

demos = []
for ep in episodes:
    demo = play_demonstration(row_of(ep), chat, random.Random(0), prefix=ep["actions"])
    if demo is None:  # the optimal play does not fit the turn budget: not a row clew eval plays
        sys.exit(f"seed {ep['seed']}: its maze is not solvable within {ep['env_options']}")
    demo.image_window = 1  # what --keep-last-k-images 1 kept in the context
    demos.append(demo)

# p(an optimal move) at each turn off the goal, split by whether the greedy move was optimal
p_opt_wrong: dict[str, list[float]] = defaultdict(list)
p_opt_right: dict[str, list[float]] = defaultdict(list)
first_wrong_seen: set[int] = set()  # episodes whose first wrong first-visit junction is known
# wrong first-visit junction choices by what the move was: into a side branch, a wall, stop
wrong_move: dict[str, list[float]] = defaultdict(list)
first_wrong: list[float] = []  # p(optimal) there, for the failed episodes
mismatch = total = 0
batch_size = 8
for start in range(0, len(demos), batch_size):
    chunk = list(
        zip(episodes[start : start + batch_size], demos[start : start + batch_size], strict=True)
    )
    batch = collate([d for _, d in chunk], chat)
    keep = torch.zeros(batch.input_ids.shape, dtype=torch.bool, device=device)
    turns = []
    for b, (ep, demo) in enumerate(chunk):
        bounds = demo.chunk_starts[1:] + [len(demo.token_ids)]
        for t, (action, end) in enumerate(zip(ep["actions"], bounds, strict=True)):
            reply_start = end - len(chat.reply_tokens(action))
            keep[b, reply_start + offset - 1] = True
            turns.append((start + b, t))
    with torch.no_grad():
        logits = logits_at(model, batch, keep, torch.float32).float()
    p = torch.softmax(logits[:, ids], -1).cpu()
    facts = {i: turn_facts(episodes[i]) for i in range(start, start + len(chunk))}
    for (i, t), row in zip(turns, p, strict=True):
        ep = episodes[i]
        group, good, opened, on_goal = facts[i][t]
        total += 1
        top = int(row.argmax())
        mismatch += names[top] != ep["actions"][t]
        if on_goal:
            continue
        p_good = float(sum(row[k] for k, kind in enumerate(kinds_of) if kind in good))
        greedy_right = kinds_of[top] in good
        for g in (group, "all turns off the goal"):
            if greedy_right:
                p_opt_right[g].append(p_good)
            else:
                p_opt_wrong[g].append(p_good)
        if not greedy_right and group == "junction, first visit":
            move = kinds_of[top]
            what = "stop" if move == "stop" else "open" if move in opened else "wall"
            wrong_move[what].append(p_good)
            if i not in first_wrong_seen and not ep["success"]:
                first_wrong.append(p_good)
            first_wrong_seen.add(i)


def histogram(values: list[float]) -> str:
    counts = [sum(lo <= v < hi for v in values) for lo, hi in zip(BINS, BINS[1:], strict=False)]
    return " ".join(
        f"[{lo:.2f},{min(hi, 1):.2f}):{c}"
        for lo, hi, c in zip(BINS, BINS[1:], counts, strict=False)
    )


print(
    f"{model_dir}: {len(episodes)} episodes, {total} turns; replay check: {mismatch} turns whose most likely word is not the one played"
)
for g in sorted(set(p_opt_wrong) | set(p_opt_right)):
    wrong, right = p_opt_wrong[g], p_opt_right[g]
    print(
        f"{g}: {len(right)} right (p(optimal) mean {sum(right) / max(len(right), 1):.3f}), {len(wrong)} wrong"
    )
    if wrong:
        print(f"  wrong, p(optimal): mean {sum(wrong) / len(wrong):.3f}; {histogram(wrong)}")
for what, values in sorted(wrong_move.items()):
    print(f"wrong first-visit junction moves {what}: {len(values)}; p(optimal) {histogram(values)}")
solved = sum(bool(ep["success"]) for ep in episodes)
print(
    f"failed episodes: {len(episodes) - solved}; their first wrong first-visit junction, p(optimal): "
    + (histogram(first_wrong) if first_wrong else "none")
)
