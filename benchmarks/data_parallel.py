"""GRPO steps on 1 and N data-parallel workers in one run: step time, tokens/s, speed-up.

Runs the same short GRPO job once per worker count (``--workers 1 2``), each a real
``clew train`` run (``clew.trainer.launch.run_grpo``): one worker in this process (the baseline,
no Ray), more as Ray actors, one per GPU (``trainer.placement.policy_num_gpus_per_node``)
or, with ``--device cpu``, per CPU (``num_cpu_workers``). Prints each run's median step
time and phases after a warm-up step, generated tokens/s, the peak device memory of a
worker, the speed-up and scaling efficiency against 1 worker, and each step against its floor:
the FLOPs and bytes of a worker's share of the episodes at the card's rates
(``benchmarks/bounds.py``, measured on CUDA unless ``--peak-tflops``/``--bandwidth-tbs``).

``--scaling strong`` keeps the batch (``--prompts`` x ``--samples``) whatever the worker
count; ``weak`` gives each worker ``--prompts`` prompts (the batch grows with the count).

    python benchmarks/data_parallel.py --preset qwen3vl-8b --device cuda --workers 1 2 \
        --set trainer.gradient_checkpointing=true
    python benchmarks/data_parallel.py --preset tiny --device cpu --workers 1 2 \\
        --prompts 4 --samples 2 --max-turns 3 --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bounds import add_hardware_flags, grpo_step_floor, hardware, model_sizes  # noqa: E402

from clew.config import load_config  # noqa: E402
from clew.data.rows import generate_rows, write_rows
from clew.envs.base import text_corpus
from clew.models import build_model
from clew.trainer.launch import run_dir_of, run_grpo

PHASES = ("generate", "update", "step")


def run(args: argparse.Namespace, model: Path, data: Path, out: Path, workers: int) -> dict:
    prompts = args.prompts * (workers if args.scaling == "weak" else 1)
    # A worker's micro-batch cannot exceed its share of the mini batch (the config refuses it).
    micro = max(1, min(args.micro_batch, prompts * args.samples // workers))
    if args.device == "cpu":
        placement = [f"trainer.placement.num_cpu_workers={workers}"]
    else:
        placement = [f"trainer.placement.policy_num_gpus_per_node={workers}"]
    cfg = load_config(
        None,
        [
            f"data.train_data=['{data}']",
            f"trainer.policy.model.path={model}",
            f"trainer.policy.model.lora.rank={args.lora_rank}",
            "trainer.policy.model.lora.alpha=32",
            f"trainer.log_path={out}",
            f"trainer.run_name=workers{workers}",
            "trainer.logger=jsonl",
            f"trainer.device={args.device}",
            f"trainer.strategy={args.strategy}",
            f"trainer.train_batch_size={prompts}",
            f"trainer.policy_mini_batch_size={prompts}",
            f"trainer.micro_train_batch_size_per_gpu={micro}",
            f"trainer.micro_forward_batch_size_per_gpu={micro}",
            f"trainer.max_steps={args.steps}",
            "trainer.eval_before_train=false",
            "trainer.eval_interval=-1",
            "trainer.ckpt_interval=-1",
            "trainer.export_best=false",
            "trainer.resume_mode=none",
            f"generator.n_samples_per_prompt={args.samples}",
            f"generator.max_turns={args.max_turns}",
            f"generator.sampling_params.max_generate_length={args.max_tokens}",
            "generator.max_input_length=8192",
            "trainer.max_prompt_length=1024",
            "trainer.policy.optimizer_config.lr=1.0e-5",
            *placement,
            *args.set,
        ],
    )
    begun = time.perf_counter()
    run_grpo(cfg)
    wall = time.perf_counter() - begun
    lines = (run_dir_of(cfg) / "metrics.jsonl").read_text().splitlines()
    steps = [h for h in map(json.loads, lines) if "timing/step" in h][1:]  # after a warm-up
    if not steps:
        raise SystemExit("no step after the warm-up: raise --steps")

    def median(key: str) -> float:
        values = [h[key] for h in steps if key in h]
        return statistics.median(values) if values else float("nan")

    memory = [v for h in steps for k, v in h.items() if k.startswith("perf/peak_memory_gb")]
    # Each worker generates and trains on its share of the episodes, in parallel.
    floor = grpo_step_floor(
        model_sizes(model),
        hardware(args),
        episodes=prompts * args.samples / workers,
        episode_tokens=median("train/episode_tokens_mean"),
        generated_tokens=median("train/generated_tokens_mean"),
    )
    return {
        "workers": workers,
        "episodes": prompts * args.samples,
        "wall": wall,
        **{ph: median(f"timing/{ph}") for ph in PHASES},
        "tokens_per_s": median("throughput/generated_tokens_per_s"),
        "peak_gb": max(memory) if memory else float("nan"),
        "floor": floor.step,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--env-id", default="maze_2d/easy")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--scaling", choices=["strong", "weak"], default="strong")
    p.add_argument("--prompts", type=int, default=24, help="per run (strong) or per worker")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps per run, the first a warm-up")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--strategy", default="fsdp", help="trainer.strategy")
    p.add_argument(
        "--micro-batch", type=int, default=16, help="at most; a worker's share of the batch caps it"
    )
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--vocab-size", type=int, default=None, help="pad the tokenizer to this")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides")
    add_hardware_flags(p)
    args = p.parse_args()
    hw = hardware(args)
    if 1 not in args.workers:
        args.workers = [1, *args.workers]  # the baseline
    opts = {"cell_px": 28, "action_format": "keyword"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        most = args.prompts * (max(args.workers) if args.scaling == "weak" else 1)
        rows = generate_rows(args.env_id, most * args.steps, env_options=opts)
        write_rows(rows, tmp / "train.parquet")
        # On a GPU the policy is drawn there (an 8B host build takes minutes and 35 GB).
        model = build_model(
            args.preset,
            tmp / "model",
            corpus=text_corpus(),
            device="cuda" if args.device == "cuda" else None,
            padded_vocab_size=args.vocab_size,
            overwrite=True,
        ).path
        if args.device == "cuda":
            import torch

            torch.cuda.empty_cache()
        results = [run(args, model, tmp / "train.parquet", tmp / "runs", n) for n in args.workers]
    base = next(r for r in results if r["workers"] == 1)
    print(
        f"GRPO on data-parallel workers ({args.scaling} scaling, {args.device}): {args.preset}, "
        f"{args.env_id}, {args.prompts} prompts x {args.samples} samples"
        f"{' per worker' if args.scaling == 'weak' else ''}, up to {args.max_turns} turns of "
        f"{args.max_tokens} tokens, LoRA rank {args.lora_rank}, strategy {args.strategy}; "
        f"medians of steps 2-{args.steps}; floors at {hw.tflops:g} TFLOP/s, {hw.tbs:g} TB/s"
    )
    print(
        "workers  episodes  step_s  generate_s  update_s  gen_tok/s  peak_GB  speed-up  "
        "efficiency  floor_s  of_floor"
    )
    for r in results:
        # Speed-up in episodes per second of step, so weak and strong read alike.
        rate = r["episodes"] / r["step"]
        speedup = rate / (base["episodes"] / base["step"])
        print(
            f"{r['workers']:>7}  {r['episodes']:>8}  {r['step']:>6.2f}  {r['generate']:>10.2f}  "
            f"{r['update']:>8.2f}  {r['tokens_per_s']:>9.0f}  {r['peak_gb']:>7.2f}  "
            f"{speedup:>7.2f}x  {speedup / r['workers']:>9.0%}  {r['floor']:>7.2f}  "
            f"{r['step'] / r['floor']:>7.1f}x"
        )


if __name__ == "__main__":
    main()
