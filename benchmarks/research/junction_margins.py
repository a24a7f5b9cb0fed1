"""How close a maze policy's wrong greedy choices were: the probability it gave an optimal move
at every turn of its own greedy episodes.

TRAJECTORIES is ``clew eval``'s trajectories.jsonl of MODEL's greedy play (keyword replies;
``--keep-last-k-images`` as the policy runs, 1 by default). Each episode's actions are
replayed as a DAgger prefix (``clew.trainer.demonstrations.play_demonstration``), so every
turn's context is the one greedy play saw, and one forward pass per batch reads the
distribution over the five action words at each turn's decision token (the other tokens
masked, as ``generator.sampling_params.allowed_tokens`` samples). A check: the most likely
word must be the action greedy play took, or the replay is not the play.

Prints, for the turns off the goal by kind of cell (first visit or revisit), where the
greedy move was not optimal (by the env's expert, ``clew.envs.expert_for``), how much
probability the optimal moves had, in bins: a wrong choice with 0.3-0.5 on the right way is
a close call that sharper training flips; one under 0.05 is a confident error that sampling
rarely explores. Then the wrong first-visit junction moves by where they went (an open side
branch, a wall, stop), and for the failed episodes the first such junction's figure. Given
several MODEL TRAJECTORIES pairs (a GRPO start first, as the baseline, then policies trained
from it), it ends with a table of the pairs side by side.

    clew dataset --env-id maze_2d/easy --option cell_px=14 --option border_px=7 \\
        --option max_turns=32 --option action_format=keyword --split eval --num-rows 256 \\
        --seed-start 2000000000 --output-dir D
    clew eval --model M --data D/eval.parquet --max-turns 32 --max-generate-length 1 \\
        --keep-last-k-images 1 --reply-prefix '<action>' --reply-suffix '</action>' \\
        --num-gifs 0 --output-dir E      # once for START (E0), once for GRPO (E1)
    python benchmarks/research/junction_margins.py START E0/trajectories.jsonl GRPO E1/trajectories.jsonl

docs/learning-easy.md quotes it on those 256 mazes for two policies that git history keeps:
the DAgger start (``git show f61e09f:checkpoints/easy-h200/sft-dagger-medium-s34/sft.tgz.part-aa``
and ``part-ab``, concatenated, ``| tar xzf - -C START``: START/sft; 68.75% greedy) and its best
GiGPO step (the same from ``25540e0:checkpoints/easy-h200/gigpo-allowed-s35/best.tgz.part-*``:
GRPO/best; 75.0%). Wrong first-visit junction choices with p(optimal) 0.30-0.50: 87 and 47;
under 0.05: 41 and 67; failed episodes whose first wrong first-visit junction had p(optimal)
under 0.15: 26 of 65 and 32 of 52; the replay check 1 and 3 turns of 5,851 and 5,598 (float
rounding). On the first 64 eval mazes (``--num-rows 64`` without ``--seed-start``) it prints
for the start, on the CPU, the figures recorded at commit f61e09f line for line
(1,546 turns, replay check 1; 63 wrong first-visit junction choices, 33 of them 0.30-0.50).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from clew.data.rows import Row
from clew.envs import expert_for, make
from clew.envs.maze.generate import DIRECTIONS
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.train.forward import logits_at
from clew.train.model_batch import collate
from clew.trainer.agreement import decision_tokens
from clew.trainer.demonstrations import play_demonstration

BINS = (0.0, 0.05, 0.15, 0.3, 0.5, 1.01)
JUNCTION = "junction, first visit"


def turn_facts(ep: dict[str, Any]) -> list[tuple[str, set[str], set[str], bool]]:
    """Per turn: the cell's kind and visit, the expert's best replies, the replies that move
    into an open cell, and whether the agent is on the goal."""
    env = make(ep["env_id"], **ep["env_options"])
    env.reset(int(ep["seed"]))
    expert, moves = expert_for(ep["env_id"]), list(env.action_names().values())
    seen: set = set()
    out = []
    for action in ep["actions"]:
        (r, c), maze = env.agent, env.maze
        opened = {
            moves[d] for d, (dr, dc) in enumerate(DIRECTIONS) if maze.is_open((r + dr, c + dc))
        }
        kind = {1: "dead end", 2: "corridor"}.get(len(opened), "junction")
        visit = "first visit" if (r, c) not in seen else "revisit"
        seen.add((r, c))
        out.append((f"{kind}, {visit}", set(expert.best_actions(env)), opened, (r, c) == maze.goal))
        env.step(action)
    return out


def histogram(values: list[float]) -> str:
    counts = [sum(lo <= v < hi for v in values) for lo, hi in zip(BINS, BINS[1:], strict=False)]
    return " ".join(
        f"[{lo:.2f},{min(hi, 1):.2f}):{c}"
        for lo, hi, c in zip(BINS, BINS[1:], counts, strict=False)
    )


def margins(model_dir: str, traj_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Print the figures of one policy's greedy episodes; the summary the table shows."""
    episodes = [json.loads(line) for line in traj_path.read_text().splitlines() if line]
    model, processor = load_policy(model_dir, "float32", args.device)
    model.eval()
    chat = ChatFormat(processor)
    probe = make(episodes[0]["env_id"], **episodes[0]["env_options"])
    decision = decision_tokens(chat, list(probe.action_names().values()))
    if decision is None:
        sys.exit("the env's action replies have no single decision token with this tokenizer")
    offset, word_of = decision
    ids = torch.tensor(sorted(word_of), device=args.device)
    names = [word_of[int(i)] for i in ids]  # the replies, e.g. <action>up</action>
    stop = probe.action_names()["stop"]
    demos = []
    for ep in episodes:
        row = Row(ep["env_id"], ep["env_options"], int(ep["seed"]), "eval", "", probe.max_turns)
        demo = play_demonstration(row, chat, random.Random(0), prefix=ep["actions"])
        if demo is None:  # the expert's play does not fit the budget: not a row clew eval plays
            sys.exit(f"seed {ep['seed']}: its maze is not solvable within {ep['env_options']}")
        demo.image_window = args.keep_last_k_images
        demos.append(demo)
    wrong: dict[str, list[float]] = defaultdict(list)  # p(optimal) where greedy was not optimal
    right: dict[str, list[float]] = defaultdict(list)
    wrong_move: dict[str, list[float]] = defaultdict(list)  # first-visit junctions: open/wall/stop
    first_wrong: dict[int, float] = {}  # per episode, at its first wrong first-visit junction
    mismatch = total = 0
    for start in range(0, len(demos), args.batch_size):
        chunk = list(range(start, min(start + args.batch_size, len(demos))))
        batch = collate([demos[i] for i in chunk], chat)
        keep = torch.zeros(batch.input_ids.shape, dtype=torch.bool, device=args.device)
        turns = []
        for b, i in enumerate(chunk):
            bounds = demos[i].chunk_starts[1:] + [len(demos[i].token_ids)]
            for t, (action, end) in enumerate(zip(episodes[i]["actions"], bounds, strict=True)):
                keep[b, end - len(chat.reply_tokens(action)) + offset - 1] = True
                turns.append((i, t))
        with torch.no_grad():
            p = torch.softmax(logits_at(model, batch, keep, torch.float32).float()[:, ids], -1)
        facts = {i: turn_facts(episodes[i]) for i in chunk}
        for (i, t), row_p in zip(turns, p.cpu(), strict=True):
            group, good, opened, on_goal = facts[i][t]
            top = names[int(row_p.argmax())]
            total += 1
            mismatch += top != episodes[i]["actions"][t]
            if on_goal:
                continue
            p_good = float(sum(row_p[k] for k, name in enumerate(names) if name in good))
            for g in (group, "all turns off the goal"):
                (right if top in good else wrong)[g].append(p_good)
            if top not in good and group == JUNCTION:
                what = "stop" if top == stop else "open" if top in opened else "wall"
                wrong_move[what].append(p_good)
                first_wrong.setdefault(i, p_good)
    failed = [i for i, ep in enumerate(episodes) if not ep["success"]]
    failed_first = [first_wrong[i] for i in failed if i in first_wrong]
    print(f"{model_dir}: {len(episodes)} episodes, {total} turns; replay check: {mismatch} "
          "turns whose most likely word is not the one played")  # fmt: skip
    for g in sorted(set(wrong) | set(right)):
        w, r = wrong[g], right[g]
        print(
            f"{g}: {len(r)} right (p(optimal) mean {sum(r) / max(len(r), 1):.3f}), {len(w)} wrong"
        )
        if w:
            print(f"  wrong, p(optimal): mean {sum(w) / len(w):.3f}; {histogram(w)}")
    for what, values in sorted(wrong_move.items()):
        print(
            f"wrong first-visit junction moves {what}: {len(values)}; p(optimal) {histogram(values)}"
        )
    print(f"failed episodes: {len(failed)}; their first wrong first-visit junction, p(optimal): "
          + (histogram(failed_first) if failed_first else "none"))  # fmt: skip
    junction = wrong[JUNCTION]
    return {
        "greedy pass@1": f"{1 - len(failed) / len(episodes):.2%}",
        "wrong first-visit junction choices": len(junction),
        "close calls, p(optimal) 0.30-0.50": sum(0.3 <= v < 0.5 for v in junction),
        "confident, p(optimal) under 0.05": sum(v < 0.05 for v in junction),
        "failures whose first wrong choice had p(optimal) under 0.15": (
            f"{sum(v < 0.15 for v in failed_first)} of {len(failed_first)}"
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pairs", nargs="+", metavar="MODEL TRAJECTORIES")
    ap.add_argument("--keep-last-k-images", type=int, default=1, help="0: all images")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if len(args.pairs) % 2:
        ap.error("give MODEL TRAJECTORIES pairs (a policy and the trajectories.jsonl of its eval)")
    args.keep_last_k_images = args.keep_last_k_images or None
    pairs = list(zip(args.pairs[::2], args.pairs[1::2], strict=True))
    summaries = [margins(m, Path(t), args) for m, t in pairs]
    if len(summaries) > 1:
        print("\n| | " + " | ".join(m for m, _ in pairs) + " |")
        print("| --- |" + " ---: |" * len(pairs))
        for key in summaries[0]:
            print(f"| {key} | " + " | ".join(str(s[key]) for s in summaries) + " |")


if __name__ == "__main__":
    main()
