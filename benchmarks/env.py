"""Env steps per second, rendering included, on one core.

Prints clew's maze env beside a baseline in the same run: the same env re-rendering every
frame from scratch with PIL drawing calls (what a straightforward implementation does).
Target (issue 2): above 5,000 steps/s per core, so rollouts never wait on the env.

    python benchmarks/env.py [--steps 20000]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from PIL import Image, ImageDraw  # noqa: E402

from clew.envs import make  # noqa: E402
from clew.envs.maze.actions import Action, format_action  # noqa: E402
from clew.envs.maze.render import AGENT_RGB, FLOOR_RGB, GOAL_RGB, WALL_RGB  # noqa: E402
from clew.envs.maze.solver import shortest_actions  # noqa: E402


def naive_render(env) -> Image.Image:
    px, maze = env.cell_px, env.maze
    img = Image.new("RGB", (maze.size * px, maze.size * px), FLOOR_RGB)
    draw = ImageDraw.Draw(img)
    for r in range(maze.size):
        for c in range(maze.size):
            if maze.walls[r, c]:
                draw.rectangle([c * px, r * px, (c + 1) * px - 1, (r + 1) * px - 1], fill=WALL_RGB)
    gr, gc = maze.goal
    draw.rectangle([gc * px, gr * px, (gc + 1) * px - 1, (gr + 1) * px - 1], fill=GOAL_RGB)
    ar, ac = env.agent
    cx, cy, rad = (ac + 0.5) * px, (ar + 0.5) * px, px / 4
    draw.ellipse([cx - rad, cy - rad, cx + rad, cy + rad], fill=AGENT_RGB)
    return img


def run(env_id: str, steps: int, naive: bool) -> float:
    env = make(env_id, max_turns=10_000)
    seed, done_steps = 0, 0
    start = time.perf_counter()
    while done_steps < steps:
        env.reset(seed)
        for d in shortest_actions(env.maze):
            obs, *_ = env.step(format_action(Action("move", d), env.action_format))
            if naive:
                naive_render(env)
            else:
                _ = obs.images[0]
            done_steps += 1
        seed += 1
    return done_steps / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20_000)
    args = p.parse_args()
    print(
        f"{'env':<14} {'clew steps/s':>13} {'naive re-render steps/s':>24}  (1 core, rendering on)"
    )
    for env_id in ("maze_2d/easy", "maze_2d/hard"):
        fast = run(env_id, args.steps, naive=False)
        slow = run(env_id, args.steps // 4, naive=True)
        print(f"{env_id:<14} {fast:>13,.0f} {slow:>24,.0f}")


if __name__ == "__main__":
    main()
