"""Commands that train: train, sft, report."""

from __future__ import annotations

import argparse

from clew.agent.flags import positive_int
from clew.commands.registry import Handler, command

# Short flags of `clew sft` and `clew pipeline`, each an alias of one config key (applied
# before the KEY=VALUE overrides, which win). docs/config.md lists them.
FLAG_ALIASES: dict[str, dict[str, str]] = {
    "sft": {
        "--model": "sft.model_path",
        "--data": "data.train_data",
        "--eval-data": "data.val_data",
        "--output": "sft.export_path",
        "--steps": "sft.steps",
        "--batch-size": "sft.batch_size",
        "--lr": "sft.optimizer_config.lr",
        "--seed": "sft.seed",
    },
    "pipeline": {"--output-dir": "trainer.log_path"},
}


def add_print_config(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration (the YAML the run saves as config.yaml) and "
        "exit without running",
    )


def printed(cfg: object, args: argparse.Namespace) -> bool:
    """With ``--print-config``: print ``cfg`` as the run would save it; True if printed."""
    if not args.print_config:
        return False
    from clew.config import config_yaml

    print(config_yaml(cfg), end="")
    return True


@command("train", "GRPO training; takes SkyRL-style dotted overrides (key=value)")
def _train(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("--config", help="YAML config file (overrides apply on top)")
    p.add_argument(
        "-m",
        "--multirun",
        action="store_true",
        help="a sweep, as Hydra's multirun: each KEY=A,B override is an axis ([A,B] and "
        "'A,B' are one value); one run per combination, one after another, in "
        "trainer.log_path/trainer.run_name/<key>=<value>,..., summarized in sweep.json there; "
        "re-running goes on, skipping finished runs",
    )
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        metavar="N",
        help="with -m: run N combinations at once, each in a process of its own sharing the "
        "machine's devices (a small policy's run leaves most of a GPU idle) and holding at "
        "most 1/N of a GPU's memory (trainer.gpu_memory_fraction), its output in its "
        "folder's train.log; 1 (the default) runs them one after another in this process",
    )
    add_print_config(p)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. trainer.epochs=2")

    def run(args: argparse.Namespace) -> int:
        from clew.config import load_config
        from clew.errors import ConfigError
        from clew.trainer.launch import run_grpo

        if args.multirun:
            return _sweep(args)
        if args.jobs != 1:
            raise ConfigError(
                f"--jobs {args.jobs} runs a sweep's combinations side by side: it needs -m "
                "(clew train -m KEY=A,B ... --jobs N)"
            )
        cfg = load_config(args.config, args.overrides)
        if printed(cfg, args):
            return 0
        metrics = run_grpo(cfg)
        for k, v in sorted(metrics.items()):
            print(f"{k}: {v:.4f}")
        return 0

    return run


def _sweep(args: argparse.Namespace) -> int:
    """``clew train -m``: every combination checked, then run (or printed); 1 if any failed."""
    from clew.config import config_yaml
    from clew.trainer.sweep import plan_sweep, run_sweep

    sweep = plan_sweep(args.config, args.overrides)
    if args.print_config:
        for i, run in enumerate(sweep.runs, 1):
            print(f"# sweep run {i} of {len(sweep.runs)}: {run.combination.name}")
            print(config_yaml(run.cfg), end="")
        return 0
    rows = run_sweep(sweep, args.jobs)
    return 1 if any(r["status"] == "failed" for r in rows) else 0


@command("sft", "supervised fine-tuning on expert demonstrations (makes a GRPO starting point)")
def _sft(p: argparse.ArgumentParser) -> Handler:
    p.epilog = (
        "Every other setting is a config key (docs/config.md, the sft section), e.g. "
        "sft.lora.rank=8 sft.dagger.interval=20 trainer.resume_mode=latest."
    )
    p.add_argument("--config", help="YAML config file (its sft section; overrides apply on top)")
    p.add_argument("--model", help="starting checkpoint directory (sft.model_path)")
    p.add_argument(
        "--data", action="append", help="train parquet (data.train_data; repeat for more)"
    )
    p.add_argument(
        "--eval-data", action="append", help="eval parquet (data.val_data; repeat for more)"
    )
    p.add_argument("--output", help="folder for the exports (sft.export_path)")
    p.add_argument("--steps", type=positive_int, help="sft.steps")
    p.add_argument("--batch-size", type=positive_int, help="sft.batch_size")
    p.add_argument("--lr", type=float, help="sft.optimizer_config.lr")
    p.add_argument("--seed", type=int, help="sft.seed")
    add_print_config(p)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. sft.dagger.interval=20")

    def run(args: argparse.Namespace) -> int:
        from clew.config import load_config
        from clew.trainer.sft_launch import run_sft_stage

        cfg = load_config(args.config, [*flag_overrides("sft", args), *args.overrides])
        if printed(cfg, args):
            return 0
        result = run_sft_stage(cfg)
        for k, v in sorted(result.last_eval.items()):
            print(f"{k}: {v:.4f}")
        print(f"SFT ended at step {result.step}; the policy is at {result.final_policy}")
        return 0

    return run


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "\\'") + "'"


def flag_overrides(command: str, args: argparse.Namespace) -> list[str]:
    """``command``'s short flags that were given, as the overrides they stand for."""
    out = []
    for flag, key in FLAG_ALIASES[command].items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is None:
            continue
        if isinstance(value, list):  # a repeatable flag: a list key
            out.append(f"{key}=[{', '.join(_quoted(v) for v in value)}]")
        else:
            out.append(f"{key}={_quoted(value) if isinstance(value, str) else repr(value)}")
    return out


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
