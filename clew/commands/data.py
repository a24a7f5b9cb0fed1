"""Commands on environments and data: envs, dataset, render."""

from __future__ import annotations

import argparse

from clew.commands.registry import Handler, _add_env_args, _env_options, command, positive_int
from clew.errors import ClewError


@command("envs", "list the registered environment ids")
def _envs(p: argparse.ArgumentParser) -> Handler:
    def run(args: argparse.Namespace) -> int:
        from clew.envs import list_envs

        for s in list_envs():
            opts = ", ".join(f"{k}={v}" for k, v in sorted(s.defaults.items()))
            print(f"{s.env_id:<16} {s.description}  [{opts}]")
        return 0

    return run


@command("dataset", "write a parquet dataset of seeded mazes, or print a dataset's statistics")
def _dataset(p: argparse.ArgumentParser) -> Handler:
    _add_env_args(p)
    p.add_argument("--num-rows", type=positive_int, default=256, help="mazes to write")
    p.add_argument("--output-dir", help="folder for SPLIT.parquet")
    p.add_argument("--split", choices=["train", "eval"], default="train")
    p.add_argument("--seed-start", type=int, default=None, help="first seed to try")
    p.add_argument("--stats", action="store_true", help="print path lengths and the solvable share")
    p.add_argument("--input", help="with --stats: read this parquet instead of generating")

    def run(args: argparse.Namespace) -> int:
        from pathlib import Path

        from clew.data.rows import dataset_stats, format_stats, generate_rows, read_rows, write_rows

        if args.input:
            if not args.stats:
                raise ClewError("--input is only used with --stats")
            rows = read_rows(args.input)
        else:
            if not args.output_dir:
                raise ClewError(
                    "--output-dir is required to write a dataset (or give --stats --input FILE)"
                )
            rows = generate_rows(
                args.env_id, args.num_rows, args.split, args.seed_start, _env_options(args)
            )
            path = write_rows(rows, Path(args.output_dir) / f"{args.split}.parquet")
            print(f"wrote {len(rows)} {args.split} rows of {args.env_id} to {path}")
        if args.stats:
            print(format_stats(dataset_stats(rows)))
        return 0

    return run


@command("render", "draw an episode as an animated GIF and a contact-sheet PNG")
def _render(p: argparse.ArgumentParser) -> Handler:
    _add_env_args(p)
    p.add_argument("--seed", type=int, default=0)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--actions", help="comma-separated right/up/left/down/stop")
    src.add_argument("--solve", action="store_true", help="play the solver's optimal path")
    src.add_argument("--trajectory", help="a trajectories JSONL file (from `clew eval`)")
    p.add_argument("--index", type=int, default=0, help="with --trajectory: which line")
    p.add_argument("--output", required=True, help="path stem: writes STEM.gif and STEM.png")

    def run(args: argparse.Namespace) -> int:
        from clew.envs import make
        from clew.envs.maze.actions import Action, format_action
        from clew.envs.maze.generate import DIRECTION_NAMES
        from clew.envs.maze.solver import shortest_actions
        from clew.envs.media import replay, write_episode

        env_id, seed, options = args.env_id, args.seed, _env_options(args)
        if args.trajectory:
            from clew.rollout.records import read_trajectory_line

            rec = read_trajectory_line(args.trajectory, args.index)
            env_id, seed, options, texts = (
                rec["env_id"],
                rec["seed"],
                rec["env_options"],
                rec["actions"],
            )
        else:
            env = make(env_id, **options)
            env.reset(seed)
            if args.solve:
                moves = [Action("move", d) for d in shortest_actions(env.maze, start=env.agent)] + [
                    Action("stop")
                ]
            else:
                words = [w.strip().lower() for w in args.actions.split(",") if w.strip()]
                bad = [w for w in words if w not in (*DIRECTION_NAMES, "stop")]
                if bad:
                    raise ClewError(
                        f"unknown action(s) {', '.join(bad)}; use right, up, left, down, stop"
                    )
                moves = [
                    Action("stop") if w == "stop" else Action("move", DIRECTION_NAMES.index(w))
                    for w in words
                ]
            texts = [format_action(m, env.action_format) for m in moves]
        result = replay(env_id, seed, texts, options)
        gif, png = write_episode(result, args.output)
        print(f"wrote {gif} and {png} ({len(result.frames) - 1} turns, reward {result.reward})")
        return 0

    return run
