"""The ``clew`` command: one entry point for data, training, evaluation and serving.

Each subcommand parses its arguments here and calls one function of the package. Errors a
user can cause (a typo, a bad path) are ``ClewError``s and print as one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from clew.errors import ClewError

Handler = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Handler, str]] = {}


def command(name: str, help_text: str):
    """Register a subcommand: the decorated function adds its arguments, and returns its handler."""

    def wrap(add_args: Callable[[argparse.ArgumentParser], Handler]):
        def add(p: argparse.ArgumentParser) -> None:
            p.set_defaults(_handler=add_args(p))

        _COMMANDS[name] = (add, None, help_text)  # type: ignore[assignment]
        return add_args

    return wrap


def parse_option(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as JSON where it can be (``7``, ``true``), else text."""
    if "=" not in text:
        raise ClewError(f"an option must look like key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _env_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(parse_option(o) for o in (args.option or []))


def _add_env_args(p: argparse.ArgumentParser, default: str | None = "maze_2d/easy") -> None:
    p.add_argument("--env-id", default=default, help="registered env id (see `clew envs`)")
    p.add_argument(
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="env option over the id's defaults, e.g. --option cell_px=28 (repeatable)",
    )


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
                moves = [Action("move", d) for d in shortest_actions(env.maze)] + [Action("stop")]
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


@command("init-model", "build a Qwen-VL policy with random weights, offline")
def _init_model(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("--preset", default="tiny", help="tiny | small | base (see clew.models.factory)")
    p.add_argument("--output", required=True, help="folder for the Hugging Face checkpoint")
    p.add_argument("--image-size", type=positive_int, default=None, help="largest image side in px")
    p.add_argument("--arch", default="qwen2_vl", help="qwen2_vl | qwen3_vl")
    p.add_argument("--patch-size", type=positive_int, default=None, help="vision patch in px")
    p.add_argument("--merge-size", type=positive_int, default=2, help="patches merged per side")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")

    def run(args: argparse.Namespace) -> int:
        from clew.envs.base import text_corpus
        from clew.models import PRESETS, build_model

        if args.preset not in PRESETS:
            raise ClewError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
        built = build_model(
            args.preset,
            args.output,
            corpus=text_corpus(),
            seed=args.seed,
            image_size=args.image_size,
            arch=args.arch,
            patch_size=args.patch_size,
            merge_size=args.merge_size,
            overwrite=args.overwrite,
        )
        print(f"wrote {args.preset} model ({built.num_parameters:,} parameters) to {built.path}")
        return 0

    return run


@command("eval", "play every maze of a dataset once, greedily, and report the solve rate")
def _eval(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--adapter", help="LoRA adapter directory (adapter_config.json)")
    p.add_argument("--data", required=True, help="eval parquet from `clew dataset --split eval`")
    p.add_argument(
        "--output-dir", default="runs/eval", help="metrics.json, trajectories.jsonl, gifs/"
    )
    p.add_argument(
        "--max-turns", type=positive_int, default=None, help="default: each env's budget"
    )
    p.add_argument("--max-generate-length", type=positive_int, default=64)
    p.add_argument("--max-input-length", type=positive_int, default=8192)
    p.add_argument("--device", default="auto")
    p.add_argument("--num-gifs", type=int, default=4)

    def run(args: argparse.Namespace) -> int:
        from clew.data.rows import read_rows
        from clew.evaluation import evaluate
        from clew.inference.engine import SamplingParams
        from clew.inference.runtime import open_policy
        from clew.rollout.loop import RolloutSettings

        rows = read_rows(args.data)
        policy = open_policy(args.model, args.adapter, device=args.device)
        settings = RolloutSettings(
            n_samples_per_prompt=1,
            max_turns=args.max_turns or max(r.max_turns for r in rows),
            max_input_length=args.max_input_length,
            sampling=SamplingParams(temperature=0.0, max_tokens=args.max_generate_length),
        )
        metrics, _ = evaluate(
            policy.engine, rows, settings, output_dir=args.output_dir, num_gifs=args.num_gifs
        )
        for k, v in metrics.items():
            print(f"{k}: {v:.4f}")
        print(f"trajectories and GIFs in {args.output_dir}")
        return 0

    return run


@command("train", "GRPO training; takes SkyRL-style dotted overrides (key=value)")
def _train(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("--config", help="YAML config file (overrides apply on top)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. trainer.epochs=2")

    def run(args: argparse.Namespace) -> int:
        from clew.config import load_config
        from clew.run import train

        cfg = load_config(args.config, args.overrides)
        metrics = train(cfg)
        for k, v in sorted(metrics.items()):
            print(f"{k}: {v:.4f}")
        return 0

    return run


@command("sft", "supervised fine-tuning on solver demonstrations (makes a GRPO starting point)")
def _sft(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("--model", required=True, help="starting checkpoint directory")
    p.add_argument("--data", required=True, help="train parquet from `clew dataset`")
    p.add_argument("--output", required=True, help="folder for the fine-tuned checkpoint")
    p.add_argument("--eval-data", help="eval parquet: report pass@1 during SFT")
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--batch-size", type=positive_int, default=16, help="episodes per step")
    p.add_argument("--micro-batch-size", type=positive_int, default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--lora-rank", type=int, default=0, help="0 trains all weights")
    p.add_argument(
        "--detour-prob", type=float, default=0.0, help="share of detour turns (VisGym-style)"
    )
    p.add_argument("--eval-interval", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)

    def run(args: argparse.Namespace) -> int:
        from clew.data.rows import read_rows
        from clew.inference.runtime import pick_device
        from clew.train.sft import run_sft

        rows = read_rows(args.data)
        eval_fn = None
        if args.eval_data:
            eval_fn = _sft_eval_fn(read_rows(args.eval_data))
        device = pick_device(args.device)
        result = run_sft(
            args.model,
            rows,
            args.output,
            steps=args.steps,
            batch_size=args.batch_size,
            micro_batch_size=args.micro_batch_size,
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            lora_rank=args.lora_rank,
            detour_prob=args.detour_prob,
            seed=args.seed,
            device=str(device),
            dtype="bfloat16" if device.type == "cuda" else "float32",
            eval_fn=eval_fn,
            eval_interval=args.eval_interval,
            log=lambda step, stats: (
                print(
                    f"sft step {step} | loss {stats['sft/loss']:.4f}"
                    + "".join(
                        f" | {k} {v:.3f}" for k, v in stats.items() if k.startswith("eval/all/pass")
                    ),
                    flush=True,
                )
                if step % 10 == 0 or "eval/all/pass_at_1" in stats
                else None
            ),
        )
        print(
            f"wrote the SFT checkpoint to {result.output_dir} ({result.num_demonstrations} demonstrations)"
        )
        return 0

    return run


def _sft_eval_fn(rows):
    from clew.evaluation import eval_metrics
    from clew.inference.engine import InferenceEngine, SamplingParams
    from clew.rollout.loop import RolloutSettings, play

    turns = max(r.max_turns for r in rows)
    settings = RolloutSettings(1, turns, 8192, SamplingParams(temperature=0.0, max_tokens=16))

    def eval_fn(model, chat, step):
        was_training = model.training
        model.eval()
        trajs = play(InferenceEngine(model, chat), rows, settings, seed=0)
        model.train(was_training)
        return eval_metrics(trajs, rows, turns)

    return eval_fn


@command("report", "draw a run's solve rate and reward against step (PNG) and print a summary")
def _report(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("run_dir", help="a run folder holding metrics.jsonl")
    p.add_argument("--output", help="PNG path (default RUN_DIR/report.png)")

    def run(args: argparse.Namespace) -> int:
        from clew.metrics import draw_report, summarize

        png = draw_report(args.run_dir, args.output)
        for k, v in summarize(args.run_dir).items():
            print(f"{k}: {v}")
        print(f"wrote {png}")
        return 0

    return run


@command(
    "export", "write a run's policy as a standalone checkpoint (adapter, or merged full weights)"
)
def _export(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("--model", required=True, help="the base checkpoint the adapter was trained on")
    p.add_argument(
        "--adapter",
        required=True,
        help="an exported adapter folder (export_path/global_step_N/policy)",
    )
    p.add_argument("--output", required=True)
    p.add_argument("--merge", action="store_true", help="merge the adapter into full weights")

    def run(args: argparse.Namespace) -> int:
        from clew.models import load_policy
        from clew.models.adapters import load_adapter

        if not args.merge:
            raise ClewError(
                "only --merge is supported: an adapter folder is already an adapter export"
            )
        model, processor = load_policy(args.model)
        merged = load_adapter(model, args.adapter).merge_and_unload()
        merged.save_pretrained(args.output)
        processor.save_pretrained(args.output)
        print(f"wrote merged weights to {args.output}")
        return 0

    return run


@command("demo", "the main job on the built-in default (what `make demo` runs)")
def _demo(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("--output-dir", default="runs/demo")
    p.add_argument("--sft-steps", type=positive_int, default=None)
    p.add_argument("--grpo-steps", type=positive_int, default=None)

    def run(args: argparse.Namespace) -> int:
        from dataclasses import replace

        from clew.demo import DemoPlan, run_demo

        plan = DemoPlan()
        if args.sft_steps:
            plan = replace(plan, sft_steps=args.sft_steps)
        if args.grpo_steps:
            plan = replace(plan, grpo_steps=args.grpo_steps)
        run_demo(args.output_dir, plan)
        return 0

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clew", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (add, _, help_text) in _COMMANDS.items():
        add(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_handler", None):
        parser.print_help()
        return 2
    try:
        return args._handler(args)
    except ClewError as exc:
        print(f"clew {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
