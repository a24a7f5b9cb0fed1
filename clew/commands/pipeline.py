"""The ``pipeline`` command: a recipe's stages (dataset, model, sft, train, test) in one run."""

from __future__ import annotations

import argparse

from clew.commands.registry import Handler, command
from clew.commands.stages import add_print_config, flag_overrides, printed


@command(
    "pipeline",
    "run a recipe (recipes/*.yaml) end to end: dataset, base model, SFT, GRPO, a held-out "
    "test; re-running it goes on where it stopped",
)
def _pipeline(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("--config", required=True, help="recipe YAML (or a run folder's config.yaml)")
    p.add_argument(
        "--output-dir",
        help="where every stage writes: an alias of trainer.log_path (a key=value wins)",
    )
    add_print_config(p)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. trainer.max_steps=10")

    def run(args: argparse.Namespace) -> int:
        from clew.config import load_config
        from clew.trainer.pipeline import check_stages, run_pipeline

        aliases = flag_overrides("pipeline", args)
        cfg = load_config(args.config, [*aliases, *args.overrides])
        check_stages(cfg)  # the chain's problems, printed or run
        if not printed(cfg, args):
            run_pipeline(cfg)
        return 0

    return run
