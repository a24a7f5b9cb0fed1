"""Commands that train: train, sft, report, demo."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from clew.commands.registry import Handler, command, positive_int
from clew.errors import ClewError


@command("train", "GRPO training; takes SkyRL-style dotted overrides (key=value)")
def _train(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("--config", help="YAML config file (overrides apply on top)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. trainer.epochs=2")

    def run(args: argparse.Namespace) -> int:
        from clew.config import load_config
        from clew.launch import run_grpo

        cfg = load_config(args.config, args.overrides)
        metrics = run_grpo(cfg)
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
    p.add_argument(
        "--pack-sequences",
        action="store_true",
        help="lay short episodes end to end in rows (same loss, less padding); "
        "--micro-batch-size then counts rows",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument(
        "--scheduler",
        # clew.train.settings.SCHEDULERS, spelled out: importing clew.train loads torch
        choices=["constant_with_warmup", "cosine", "linear"],
        default="constant_with_warmup",
        help="learning-rate schedule after the warmup; cosine and linear decay to 0 at --steps",
    )
    p.add_argument("--lora-rank", type=int, default=0, help="0 trains all weights")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA scale numerator")
    p.add_argument(
        "--lora-target-modules",
        default="all-linear",
        help="'all-linear' (the language model), 'vision_and_language', or a peft regex",
    )
    p.add_argument(
        "--detour-prob", type=float, default=0.0, help="share of detour turns (VisGym-style)"
    )
    p.add_argument(
        "--start-anywhere",
        type=float,
        default=0.0,
        help="share of demonstrations that start on a random open cell, in [0, 1]",
    )
    p.add_argument("--eval-interval", type=int, default=0)
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop (evaluate and save) at the first step past this wall-clock budget",
    )
    p.add_argument(
        "--stop-at-pass",
        type=float,
        default=None,
        help="stop (and save) at the first evaluation whose pass@1 reaches this, in (0, 1]",
    )
    p.add_argument(
        "--save-interval",
        type=int,
        default=0,
        help="also save the policy every N steps to OUTPUT/step_N (0: only the final one)",
    )
    p.add_argument(
        "--save-best",
        action="store_true",
        help="keep the best evaluation's policy in OUTPUT/best/policy, best.json naming its "
        "step (needs --eval-data)",
    )
    p.add_argument(
        "--dagger-interval",
        type=int,
        default=0,
        help="DAgger: every N steps the policy plays training rows and the solver labels "
        "where it went wrong (clew.train.dagger); 0: off",
    )
    p.add_argument("--dagger-rows", type=positive_int, default=64, help="rows played a round")
    p.add_argument(
        "--dagger-share",
        type=float,
        default=0.5,
        help="share of each batch from the branch demonstrations, in (0, 1]",
    )
    p.add_argument(
        "--dagger-keep-rounds",
        type=int,
        default=1,
        help="rounds whose branch demonstrations the batches draw from, the latest first; "
        "0: every round (DAgger's dataset aggregation, 1-2 MB of frames a demonstration)",
    )
    p.add_argument(
        "--dagger-temperature", type=float, default=1.0, help="the policy's sampling temperature"
    )
    p.add_argument("--metrics", help="append one JSON line of metrics per step to this file")
    p.add_argument(
        "--keep-last-k-images",
        type=positive_int,
        default=None,
        help="train (and evaluate) with only the last K images visible, as "
        "generator.keep_last_k_images will run the policy",
    )
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--precision",
        default="bf16-mixed",
        help="bf16-mixed | bf16-true | 32-true. On CUDA: float32 weights with bfloat16 compute (bf16-mixed), bfloat16 weights "
        "(bf16-true) or float32 (32-true); float32 elsewhere (clew.models.precision)",
    )
    p.add_argument("--seed", type=int, default=0)

    def run(args: argparse.Namespace) -> int:
        from clew.data.rows import read_rows
        from clew.inference.runtime import limit_host_threads, pick_device
        from clew.models.precision import policy_precision
        from clew.train.dagger import DaggerSettings
        from clew.train.sft import run_sft

        rows = read_rows(args.data)
        device = pick_device(args.device)
        limit_host_threads(device)
        dtype, autocast = policy_precision(device, args.precision, args.lora_rank > 0)
        eval_fn = None
        if args.eval_data:
            eval_fn = _sft_eval_fn(read_rows(args.eval_data), args.keep_last_k_images, autocast)
        if args.dagger_interval < 0:
            raise ClewError(f"--dagger-interval must be >= 0 (0: off), got {args.dagger_interval}")
        dagger = None
        if args.dagger_interval:
            dagger = DaggerSettings(
                interval=args.dagger_interval,
                rows=args.dagger_rows,
                share=args.dagger_share,
                temperature=args.dagger_temperature,
                keep_rounds=args.dagger_keep_rounds,
            )
        if args.max_minutes is not None and args.max_minutes <= 0:
            raise ClewError(f"--max-minutes must be positive, got {args.max_minutes}")
        metrics_file = Path(args.metrics) if args.metrics else None
        if metrics_file is not None:
            metrics_file.parent.mkdir(parents=True, exist_ok=True)

        def log(step: int, stats: dict[str, float]) -> None:
            if metrics_file is not None:
                with metrics_file.open("a") as f:
                    f.write(json.dumps({"step": step, **stats}) + "\n")
            if step % 10 == 0 or "eval/all/pass_at_1" in stats:
                passes = "".join(
                    f" | {k} {v:.3f}" for k, v in stats.items() if k.startswith("eval/all/pass")
                )
                print(
                    f"sft step {step} | loss {stats['sft/loss']:.4f} | "
                    f"{stats['sft/elapsed_s']:.0f} s{passes}",
                    flush=True,
                )

        result = run_sft(
            args.model,
            rows,
            args.output,
            steps=args.steps,
            batch_size=args.batch_size,
            micro_batch_size=args.micro_batch_size,
            pack_sequences=args.pack_sequences,
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            scheduler=args.scheduler,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            lora_target_modules=args.lora_target_modules,
            detour_prob=args.detour_prob,
            start_anywhere=args.start_anywhere,
            keep_last_k_images=args.keep_last_k_images,
            max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
            stop_at_pass=args.stop_at_pass,
            seed=args.seed,
            device=str(device),
            dtype=dtype,
            autocast_bf16=autocast,
            eval_fn=eval_fn,
            eval_interval=args.eval_interval,
            save_interval=args.save_interval,
            save_best=args.save_best,
            dagger=dagger,
            log=log,
        )
        print(
            f"wrote the SFT checkpoint to {result.output_dir} ({result.num_demonstrations} demonstrations)"
        )
        return 0

    return run


def _sft_eval_fn(rows, keep_last_k_images=None, autocast=False):
    from clew.evaluation import eval_metrics
    from clew.inference.sampling import SamplingParams
    from clew.rollout.loop import RolloutSettings, play_model
    from clew.train.agreement import solver_agreement

    turns = max(r.max_turns for r in rows)
    settings = RolloutSettings(
        1,
        turns,
        8192,
        SamplingParams(temperature=0.0, max_tokens=16),
        keep_last_k_images=keep_last_k_images,
    )

    def eval_fn(model, chat, step):
        trajs = play_model(model, chat, rows, settings, autocast=autocast)
        agreement = solver_agreement(
            model, chat, rows, image_window=keep_last_k_images, autocast=autocast
        )
        return eval_metrics(trajs, rows, turns) | agreement

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
