"""The engine-against-trainer logprob guard at a model's scale, and what each correction costs.

Plays one batch of rollouts with the run's engine (``clew.trainer.launch.build_worker_group``: the
same precision, KV cache and merged LoRA weights a GRPO run samples with), then takes the
PPO update on it three times from the same weights: with the engine's logprobs as PPO's old
policy (the baseline: the guard read off the update's first forward, no extra pass), with
``trainer.algorithm.recompute_old_logprobs`` and with ``use_tis``. Printed per variant: the
update's seconds and its ratio to the baseline's, ``policy/logprob_diff_{mean,max,
frac_over_0.1}`` (how far the engine's sampling logprobs are from the trainer's forward)
and, with TIS, the mean weight and the share the cap bounds.

    python benchmarks/logprob_guard.py --preset qwen3vl-8b --device cuda --lora-rank 32
    python benchmarks/logprob_guard.py --preset qwen3vl-8b --device cuda --vocab-size 151936
    python benchmarks/logprob_guard.py --preset tiny --device cpu --prompts 2 --samples 2 \
        --max-turns 2
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from clew.config import load_config
from clew.config.settings import ppo_settings, rollout_settings
from clew.data.rows import generate_rows, write_rows
from clew.envs.base import text_corpus
from clew.models import build_model
from clew.train.training_batch import TrainingBatch
from clew.trainer.launch import build_worker_group

GUARD = ("logprob_diff_mean", "logprob_diff_max", "logprob_diff_frac_over_0.1")
VARIANTS = {
    "engine old logprobs (baseline)": {},
    "recompute_old_logprobs": {"recompute_old_logprobs": True},
    "use_tis (cap 2)": {"use_tis": True, "tis_imp_ratio_cap": 2.0},
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3vl-8b")
    p.add_argument("--model", default=None, help="a checkpoint instead of building --preset")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab-size", type=int, default=None, help="pad the tokenizer to this")
    p.add_argument("--env-id", default="maze_2d/easy")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = generate_rows(
            args.env_id, args.prompts, env_options={"cell_px": 28, "action_format": "keyword"}
        )
        write_rows(rows, tmp / "train.parquet")
        model = args.model
        if model is None:
            on_device = args.device if args.device.startswith("cuda") else None
            built = build_model(
                args.preset,
                tmp / "model",
                corpus=text_corpus(),
                device=on_device,
                padded_vocab_size=args.vocab_size,
            )
            model = str(built.path)
            del built
        # The micro-batch cannot exceed the mini batch (the config refuses it).
        micro = max(1, min(args.micro_batch, args.prompts * args.samples))
        cfg = load_config(
            None,
            [
                f"data.train_data=['{tmp / 'train.parquet'}']",
                f"trainer.policy.model.path={model}",
                f"trainer.policy.model.lora.rank={args.lora_rank}",
                "trainer.policy.model.lora.alpha=32",
                f"trainer.device={args.device}",
                f"trainer.train_batch_size={args.prompts}",
                f"trainer.policy_mini_batch_size={args.prompts}",
                f"trainer.micro_train_batch_size_per_gpu={micro}",
                f"trainer.micro_forward_batch_size_per_gpu={micro}",
                f"generator.n_samples_per_prompt={args.samples}",
                f"generator.max_turns={args.max_turns}",
                f"generator.sampling_params.max_generate_length={args.max_tokens}",
                "generator.sampling_params.temperature=1.0",
                "trainer.policy.optimizer_config.lr=1.0e-6",
            ],
        )
        group = build_worker_group(cfg, num_train_rows=len(rows))
        worker = group.worker
        start = worker.state_dict()
        t0 = time.perf_counter()
        trajs = group.generate(rows, rollout_settings(cfg, evaluation=False), seed=0)
        played = time.perf_counter() - t0
        tokens = sum(t.generated_tokens for t in trajs)
        advantages = torch.randn(len(trajs))  # any signs: the update's cost is what is timed
        batch = TrainingBatch.from_trajectories(trajs, advantages)
        print(
            f"{args.preset if args.model is None else args.model} on {args.device}, LoRA rank "
            f"{args.lora_rank}: {len(trajs)} episodes, {tokens} generated tokens, played in "
            f"{played:.1f} s; one optimizer step over the batch"
        )
        base = ppo_settings(cfg)
        baseline_s = None
        for name, switches in VARIANTS.items():
            worker.load_state_dict(start)  # every variant updates from the same weights
            _sync(args.device)
            t0 = time.perf_counter()
            stats = worker.train_batch(batch, dataclasses.replace(base, **switches))
            _sync(args.device)
            seconds = time.perf_counter() - t0
            baseline_s = baseline_s or seconds
            guard = ", ".join(f"{k} {stats[f'policy/{k}']:.3g}" for k in GUARD)
            tis = ""
            if "policy/tis_weight_mean" in stats:
                tis = (
                    f"; TIS weight mean {stats['policy/tis_weight_mean']:.4f}, capped "
                    f"{stats['policy/tis_capped_fraction']:.3%}"
                )
            print(
                f"{name:32} update {seconds:7.2f} s ({seconds / baseline_s:.2f}x the "
                f"baseline); {guard}{tis}"
            )


if __name__ == "__main__":
    main()
