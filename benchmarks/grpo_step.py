"""Time per phase of GRPO steps at the seed's batch shape (24 prompts x 8 samples).

Runs ``--steps`` full trainer steps (generate, score, advantages, update, sync) on a
policy built offline, and prints each phase's seconds and how many waves the episodes ran
in (``train/waves``: more than one when the KV cache budget,
``generator.inference_engine.gpu_memory_utilization``, cannot hold them all at once), and
how far the engine's sampling logprobs were from the trainer's forward over the same tokens
(``policy/logprob_diff_mean`` / ``_max``: the guard against kernels that change what is
sampled); on a GPU, the peak device memory of the generate and update phases. The
baseline, in the same run, is the generate phase done the way a user without an engine would: re-encode the whole
conversation and call ``model.generate`` every turn (``benchmarks/rollout.py``).

    python benchmarks/grpo_step.py --preset base --device cuda --max-turns 15
    python benchmarks/grpo_step.py --preset tiny --prompts 4 --samples 4 --max-turns 6

``--forced``: the reply's format written by the engine (``generator.reply_prefix`` /
``reply_suffix``), one sampled token a turn (``benchmarks/forced_reply.py`` compares the
two on one batch). ``--compare-set KEY=VALUE ...`` runs the same steps a second time, on the
same policy and data, with those overrides added, and prints each phase's ratio of the two
runs' last steps: what a switch buys in a whole step, on one machine.

    python benchmarks/grpo_step.py --preset qwen3vl-8b --device cuda --skip-baseline \
        --compare-set generator.inference_engine.fused_pointwise=false
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bounds import add_hardware_flags, grpo_step_floor, hardware, model_sizes  # noqa: E402
from rollout_sides import baseline  # noqa: E402

from clew.config import load_config  # noqa: E402
from clew.data.rows import generate_rows, write_rows  # noqa: E402
from clew.envs.base import text_corpus  # noqa: E402
from clew.models import build_model  # noqa: E402
from clew.trainer.launch import run_dir_of, run_grpo  # noqa: E402

PHASES = ("generate", "score", "advantages", "update", "sync", "step")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--env-id", default="maze_2d/easy")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=15)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--device", default="auto")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--vocab-size", type=int, default=None, help="pad the tokenizer to this")
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides"
    )
    p.add_argument(
        "--compare-set",
        nargs="*",
        default=None,
        metavar="KEY=VALUE",
        help="run the steps again with these overrides too, and compare the two",
    )
    p.add_argument(
        "--forced",
        action="store_true",
        help="the engine writes <action> and </action>, the policy samples one token a turn",
    )
    add_hardware_flags(p)
    args = p.parse_args()
    hardware(args)  # the bounds: measured on CUDA unless given (benchmarks/bounds.py)
    forced = ["generator.reply_prefix=<action>", "generator.reply_suffix=</action>"]
    opts = {"cell_px": 28, "action_format": "keyword"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = generate_rows(args.env_id, args.prompts * args.steps, env_options=opts)
        write_rows(rows, tmp / "train.parquet")
        cuda = args.device.startswith("cuda") or (
            args.device == "auto" and torch.cuda.is_available()
        )
        # On a GPU the policy is drawn there (an 8B host build takes minutes and 35 GB).
        model = build_model(
            args.preset,
            tmp / "model",
            corpus=text_corpus(),
            device="cuda" if cuda else None,
            padded_vocab_size=args.vocab_size,
            overwrite=True,
        ).path
        if cuda:
            torch.cuda.empty_cache()
        overrides = [
            f"data.train_data=['{tmp / 'train.parquet'}']",
            f"trainer.policy.model.path={model}",
            f"trainer.policy.model.lora.rank={args.lora_rank}",
            "trainer.policy.model.lora.alpha=32",
            f"trainer.log_path={tmp / 'runs'}",
            "trainer.run_name=bench",
            "trainer.logger=jsonl",
            f"trainer.device={args.device}",
            f"trainer.train_batch_size={args.prompts}",
            f"trainer.policy_mini_batch_size={max(args.prompts // 2, 1)}",
            f"trainer.micro_train_batch_size_per_gpu={args.micro_batch}",
            f"trainer.micro_forward_batch_size_per_gpu={args.micro_batch}",
            "trainer.eval_before_train=false",
            "trainer.ckpt_interval=-1",
            "trainer.resume_mode=none",
            f"generator.n_samples_per_prompt={args.samples}",
            f"generator.max_turns={args.max_turns}",
            f"generator.sampling_params.max_generate_length={1 if args.forced else args.max_tokens}",
            "generator.sampling_params.temperature=1.0",
            "generator.max_input_length=8192",
            "trainer.max_prompt_length=1024",
            "trainer.policy.optimizer_config.lr=1.0e-5",
            *(forced if args.forced else []),
            *args.set,
        ]
        cfg = load_config(None, overrides)
        history = _steps(cfg, args, "")
        last = history[-1]
        floor = grpo_step_floor(
            model_sizes(model),
            hardware(args),
            episodes=args.prompts * args.samples,
            episode_tokens=last.get("train/episode_tokens_mean", 0.0),
            generated_tokens=last.get("train/generated_tokens_mean", 0.0),
        )
        measured = {ph: last.get(f"timing/{ph}", float("nan")) for ph in PHASES}
        print(
            f"floor of the last step ({args.peak_tflops:g} TFLOP/s, {args.bandwidth_tbs:g} TB/s; "
            "benchmarks/bounds.py): "
            f"generate {floor.generate:.2f} s (prefill {floor.prefill:.2f} + decode "
            f"{floor.decode:.2f}), update {floor.update:.2f} s, step {floor.step:.2f} s; "
            f"measured/floor: generate {measured['generate'] / floor.generate:.1f}x, update "
            f"{measured['update'] / floor.update:.1f}x, step {measured['step'] / floor.step:.1f}x"
        )
        if args.compare_set is not None:
            other = load_config(
                None, [*overrides, *args.compare_set, "trainer.run_name=bench-compare"]
            )
            if cuda:
                gc.collect()
                torch.cuda.empty_cache()
            theirs = _steps(other, args, f" with {' '.join(args.compare_set)}")[-1]
            cells = []
            for ph in ("generate", "update", "step"):
                mine, other_s = last.get(f"timing/{ph}", 0.0), theirs.get(f"timing/{ph}", 0.0)
                cells.append(
                    f"{ph} {mine:.2f} / {other_s:.2f} s = {mine / max(other_s, 1e-9):.2f}x"
                )
            print("last step, the first run against the second: " + ", ".join(cells))
        if not args.skip_baseline:
            from clew.inference.runtime import open_policy

            policy = open_policy(model, device=args.device)
            t0 = time.perf_counter()
            baseline(policy, rows[: args.prompts], args.samples, args.max_turns, args.max_tokens)
            print(
                f"baseline generate phase (re-encoding model.generate, same batch): "
                f"{time.perf_counter() - t0:.2f} s"
            )


def _steps(cfg, args, label: str) -> list[dict]:
    """Run ``cfg``'s GRPO steps; print and return each step's metrics."""
    t0 = time.perf_counter()
    run_grpo(cfg)
    wall = time.perf_counter() - t0
    history = [json.loads(x) for x in (run_dir_of(cfg) / "metrics.jsonl").read_text().splitlines()]
    forced = ", reply format forced" if args.forced else ""
    print(
        f"GRPO step{label}: {args.prompts} prompts x {args.samples} samples, up to "
        f"{args.max_turns} turns, {args.preset}, LoRA rank {args.lora_rank}{forced}; "
        f"{len(history)} steps in {wall:.1f} s (with start-up)"
    )
    print(
        "step " + " ".join(f"{ph:>10}" for ph in PHASES)
        + "   episodes  turns/ep  waves  peak GB gen/upd  lp diff mean / max"
    )  # fmt: skip
    for h in history:
        cells = " ".join(f"{h.get(f'timing/{ph}', 0.0):>10.2f}" for ph in PHASES)
        diff = (
            f"{h['policy/logprob_diff_mean']:.2e} / {h.get('policy/logprob_diff_max', 0):.2e}"
            if "policy/logprob_diff_mean" in h
            else "-"
        )
        peaks = "/".join(
            f"{h[k]:.1f}" if k in h else "-"
            for k in ("perf/peak_memory_gb/generate", "perf/peak_memory_gb/update")
        )
        print(
            f"{h['step']:>4} {cells}   {args.prompts * args.samples:>8} "
            f"{h.get('train/turns_mean', 0):>9.1f} {h.get('train/waves', 0):>6.0f} "
            f"{peaks:>16}  {diff}"
        )
    return history


if __name__ == "__main__":
    main()
