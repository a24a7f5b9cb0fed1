"""Commands on environments and data: envs, dataset, render.

They reach an env only through the registry and its protocols: ``dataset`` through
``clew.data.rows`` (the env's dataset hooks), ``render --solve`` through the env's expert
and ``render --actions`` through the names the env gives its actions.
"""

from __future__ import annotations

import argparse

from clew.agent.flags import positive_int
from clew.commands.registry import Handler, _add_env_args, _env_options, command
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


@command("dataset", "write a parquet dataset of seeded episodes, or print a dataset's statistics")
def _dataset(p: argparse.ArgumentParser) -> Handler:
    _add_env_args(p)
    p.add_argument(
        "--num-rows",
        type=positive_int,
        default=None,
        help="rows (episodes) to write; default 256, or all of a recorded set's (the maze's "
        "--option layout=visgym_easy_eval: VisGym's 64 eval mazes, seeds 0-63)",
    )
    p.add_argument("--output-dir", help="folder for SPLIT.parquet")
    p.add_argument("--split", choices=["train", "eval"], default="train")
    p.add_argument("--seed-start", type=int, default=None, help="first seed to try")
    p.add_argument(
        "--stats",
        action="store_true",
        help="print the solvable share and the env's own statistics (a maze's path lengths)",
    )
    p.add_argument("--input", help="with --stats: read this parquet instead of generating")

    def run(args: argparse.Namespace) -> int:
        from pathlib import Path

        from clew.data.rows import (
            dataset_stats,
            format_stats,
            generate_rows,
            read_rows,
            task_seeds,
            write_rows,
        )

        if args.input:
            if not args.stats:
                raise ClewError("--input is only used with --stats")
            rows = read_rows(args.input)
        else:
            if not args.output_dir:
                raise ClewError(
                    "--output-dir is required to write a dataset (or give --stats --input FILE)"
                )
            options = _env_options(args)
            num_rows = args.num_rows
            if num_rows is None:
                # Every task of a recorded set from the first seed on, else 256 rows.
                fixed = task_seeds(args.env_id, options)
                num_rows = 256
                if fixed is not None:
                    start = fixed.start if args.seed_start is None else args.seed_start
                    num_rows = max(len(range(start, fixed.stop)), 1)
            rows = generate_rows(args.env_id, num_rows, args.split, args.seed_start, options)
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
    src.add_argument(
        "--actions", help="comma-separated action names (a maze's: right/up/left/down/stop)"
    )
    src.add_argument("--solve", action="store_true", help="play the env's expert")
    src.add_argument("--trajectory", help="a trajectories JSONL file (from `clew eval`)")
    p.add_argument("--index", type=int, default=0, help="with --trajectory: which line")
    p.add_argument("--output", required=True, help="path stem: writes STEM.gif and STEM.png")

    def run(args: argparse.Namespace) -> int:
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
        elif args.solve:
            texts = _expert_replies(env_id, seed, options)
        else:
            texts = _named_replies(env_id, options, args.actions)
        result = replay(env_id, seed, texts, options)
        gif, png = write_episode(result, args.output)
        print(f"wrote {gif} and {png} ({len(result.frames) - 1} turns, reward {result.reward})")
        return 0

    return run


def _expert_replies(env_id: str, seed: int, options: dict) -> list[str]:
    """The replies of the env's expert playing ``seed`` to the end (its first best reply
    each turn)."""
    from clew.envs import expert_for, make

    expert = expert_for(env_id)
    env = make(env_id, **options)
    env.reset(seed)
    texts: list[str] = []
    done = False
    while not done and len(texts) < env.max_turns:
        best = expert.best_actions(env)
        if not best:
            break
        texts.append(best[0])
        done = env.step(best[0])[2]
    return texts


def _named_replies(env_id: str, options: dict, actions: str) -> list[str]:
    """The replies of the comma-separated action names in ``actions``."""
    from clew.envs import NamedActions, make

    env = make(env_id, **options)
    if not isinstance(env, NamedActions):
        raise ClewError(f"{env_id} does not name its actions; use --solve or --trajectory")
    names = env.action_names()
    words = [w.strip().lower() for w in actions.split(",") if w.strip()]
    bad = [w for w in words if w not in names]
    if bad:
        raise ClewError(f"unknown action(s) {', '.join(bad)}; use {', '.join(names)}")
    return [names[w] for w in words]
