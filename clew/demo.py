"""The main job a newcomer runs first (``make demo``): every stage on the built-in default.

Stages so far: the train and eval datasets with their statistics, and a picture of the
solver playing one eval maze. Training, evaluation and the report join as they land.
"""

from __future__ import annotations

from pathlib import Path

from clew.data.rows import dataset_stats, format_stats, generate_rows, write_rows
from clew.envs import make
from clew.envs.maze.actions import Action, format_action
from clew.envs.maze.solver import shortest_actions
from clew.envs.media import replay, write_episode

DEMO_ENV = "maze_2d/easy"


def run_demo(
    output_dir: str | Path, env_id: str = DEMO_ENV, train_rows: int = 256, eval_rows: int = 64
) -> Path:
    out = Path(output_dir)
    data = out / "data"
    for split, n in (("train", train_rows), ("eval", eval_rows)):
        rows = generate_rows(env_id, n, split)
        path = write_rows(rows, data / f"{split}.parquet")
        print(f"== {split} set: {path}")
        print(format_stats(dataset_stats(rows)))
    first_eval = generate_rows(env_id, 1, "eval")[0]
    env = make(env_id, **first_eval.options())
    env.reset(first_eval.seed)
    texts = [
        format_action(Action("move", d), env.action_format) for d in shortest_actions(env.maze)
    ]
    texts.append(format_action(Action("stop"), env.action_format))
    gif, png = write_episode(
        replay(env_id, first_eval.seed, texts, first_eval.options()), out / "solver_episode"
    )
    print(f"== the solver on eval maze seed {first_eval.seed}: {gif}, {png}")
    return out
