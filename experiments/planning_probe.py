"""Can one forward pass plan a maze_2d/easy move, and does it take depth? (symbolic, CPU)

    python experiments/planning_probe.py STEPS DEVICE LAYERS [LAYERS ...]
    WIDTH=64 BATCH=64 python experiments/planning_probe.py ...   # a CPU-sized model

The question the GPU runs left (BENCHMARKS.md, "Ninth attempt"): the `small` policy reads
its walls, yet on the solver's path it agrees with the solver at only 59-70% of junctions,
and GRPO lowered that. Is a one-pass plan over a 9x9 maze too much for 6 language layers?
Here vision is taken out: a maze state is 81 tokens (wall, floor, agent, goal; raster
order) and a query token, and a causal Qwen3 text model of the policy's width (256, 4
heads, 2 kv heads, mlp 1024) with LAYERS layers names the solver's next move from the
query's last hidden state. Training states: any open cell of train-split mazes (the agent
anywhere, as after a detour); evaluation: every open cell but the goal of the 64 fixed eval
mazes, overall and at junctions (three or more open neighbours: a choice of ways on). Each
LAYERS trains STEPS steps of BATCH (256) states from the same seed, one after the other
(bfloat16 autocast on cuda); WIDTH (256) sets the width, with the policy's proportions,
HEADS (4) the attention heads (2 at WIDTH=128: head_dim 64, as ``pixel_planning_probe.py``). A GPU question: on the 2-core CPU a 2-layer model takes about 2 s a step.

Beside it, in the same run, a policy that does not plan (`no_plan_bounds.greedy_move`: the
open move that most shortens the straight-line distance to the goal) on the same states.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
from no_plan_bounds import greedy_move
from transformers import Qwen3Config, Qwen3Model

from clew.data.rows import generate_rows, split_of_layout
from clew.envs import make
from clew.envs.maze.generate import DIRECTIONS, Maze, generate_maze
from clew.envs.maze.solver import distances_to, next_move

SIZE = 9
WALL, FLOOR, AGENT, GOAL, QUERY = range(5)


def encode(maze: Maze) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cell tokens with the goal marked, distances to the goal, and the solver's move at
    every cell (-1 on walls and the goal)."""
    tokens = np.where(maze.walls, WALL, FLOOR).astype(np.int64)
    tokens[maze.goal] = GOAL
    dist = distances_to(maze, maze.goal)
    move = np.full(maze.walls.shape, -1, dtype=np.int64)
    for r, c in zip(*np.nonzero(dist > 0), strict=True):
        move[r, c] = next_move(maze, dist, (r, c))
    return tokens.ravel(), dist.ravel(), move.ravel()


def states(mazes: list[Maze]) -> tuple[torch.Tensor, ...]:
    """Every (maze, agent cell) with a solver move: input ids, labels, junction mask, dist,
    and whether the greedy no-plan move (``no_plan_bounds.greedy_move``) is the solver's."""
    ids, labels, junction, dists, greedy = [], [], [], [], []
    for maze in mazes:
        tokens, dist, move = encode(maze)
        for cell in np.nonzero(move >= 0)[0]:
            t = tokens.copy()
            t[cell] = AGENT
            ids.append(np.append(t, QUERY))
            labels.append(move[cell])
            r, c = divmod(int(cell), SIZE)
            exits = sum(maze.is_open((r + dr, c + dc)) for dr, dc in DIRECTIONS)
            junction.append(exits >= 3)
            dists.append(dist[cell])
            greedy.append(greedy_move(maze, (r, c)) == move[cell])
    return (
        torch.tensor(np.array(ids)),
        torch.tensor(labels),
        torch.tensor(junction),
        torch.tensor(dists),
        torch.tensor(greedy),
    )


def model_of(layers: int, width: int = 256, heads: int = 4) -> tuple[Qwen3Model, torch.nn.Linear]:
    config = Qwen3Config(
        vocab_size=8,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=width // heads,
        max_position_embeddings=128,
    )
    return Qwen3Model(config), torch.nn.Linear(width, len(DIRECTIONS))


def accuracy(model, head, ids, labels, mask=None) -> float:
    model.eval()
    cuda = ids.device.type == "cuda"
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=cuda):
        right = []
        for i in range(0, len(ids), 512):
            h = model(input_ids=ids[i : i + 512]).last_hidden_state[:, -1]
            right.append(head(h).argmax(-1) == labels[i : i + 512])
        right = torch.cat(right)
    model.train()
    return float(right[mask].float().mean() if mask is not None else right.float().mean())


def optimizer_step(opt, sched, params: list, loss: torch.Tensor) -> None:
    """One AdamW step of the probes: gradients clipped to norm 1, then the warmup schedule."""
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()


def probe_mazes() -> tuple[list[Maze], list[Maze]]:
    """The 64 fixed eval mazes of maze_2d/easy, and the first 20,000 train-split layouts."""
    eval_mazes = []
    for row in generate_rows("maze_2d/easy", 64, "eval"):
        env = make(row.env_id, **row.options())
        env.reset(int(row.seed))
        eval_mazes.append(env.maze)
    train_mazes, seed = [], 0
    while len(train_mazes) < 20_000:
        maze = generate_maze(SIZE, seed)
        seed += 1
        if split_of_layout(maze.layout_key()) == "train":
            train_mazes.append(maze)
    return eval_mazes, train_mazes


def main() -> None:
    steps, device = int(sys.argv[1]), sys.argv[2]
    width, batch = int(os.environ.get("WIDTH", 256)), int(os.environ.get("BATCH", 256))
    heads = int(os.environ.get("HEADS", 4))
    depths = [int(a) for a in sys.argv[3:]] or [6]
    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("THREADS", 2)))
    eval_mazes, train_mazes = probe_mazes()
    train = [t.to(device) for t in states(train_mazes)[:2]]
    ev_ids, ev_labels, ev_junction, ev_dist, ev_greedy = (t.to(device) for t in states(eval_mazes))
    far = ev_dist >= 12
    print(f"{len(train[0])} training states from {len(train_mazes)} mazes; eval {len(ev_ids)} "
          f"states of 64 mazes ({int(ev_junction.sum())} at junctions)")  # fmt: skip
    print(f"no plan, greedy straight-line: all {ev_greedy.float().mean():.1%} junction "
          f"{ev_greedy[ev_junction].float().mean():.1%} 12+ from the goal "
          f"{ev_greedy[far].float().mean():.1%}")  # fmt: skip
    for layers in depths:
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        model, head = (m.to(device) for m in model_of(layers, width, heads))
        params = list(model.parameters()) + list(head.parameters())
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
        start = time.perf_counter()
        for step in range(1, steps + 1):
            pick = torch.randint(len(train[0]), (batch,), generator=gen).to(device)
            with torch.autocast("cuda", torch.bfloat16, enabled=device.startswith("cuda")):
                h = model(input_ids=train[0][pick]).last_hidden_state[:, -1]
                loss = torch.nn.functional.cross_entropy(head(h).float(), train[1][pick])
            optimizer_step(opt, sched, params, loss)
            if step % max(1, steps // 5) == 0 or step == steps:
                all_ = accuracy(model, head, ev_ids, ev_labels)
                junction = accuracy(model, head, ev_ids, ev_labels, ev_junction)
                far_acc = accuracy(model, head, ev_ids, ev_labels, far)
                print(
                    f"layers {layers:2d} step {step:5d} ({time.perf_counter() - start:6.0f} s) "
                    f"loss {loss.item():.3f} | eval all {all_:.1%} junction {junction:.1%} "
                    f"12+ from the goal {far_acc:.1%}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
