"""GRPO steps per minute of a recipe's training phase under each set of switches, in one run.

The small-model regime: the one-GPU ``maze_2d/easy`` recipe (``recipes/easy-1gpu.yaml``,
the 19M-parameter ``medium`` policy, 24 prompts x 8 samples, up to 32 one-token turns).
The recipe's dataset and model stages build the policy (random weights, no SFT: episodes
run to the turn budget, a step's worst case), then its GRPO phase runs ``--steps`` steps
per variant from the same weights, evaluation and checkpoints off:

- ``after``: the recipe's own settings;

and each of the recipe's speed settings turned back to the default, one at a time, to show
what it buys (a recipe that does not set one runs ``after`` again):

- ``padded_update``: right-padded micro-batches in the update
  (``trainer.remove_microbatch_padding=false``);
- ``eager_prefill``: each turn's prefill layers run eagerly
  (``generator.inference_engine.prefill_cuda_graphs=false``);
- ``eager``: every decode step run eagerly (``generator.inference_engine.enforce_eager=true``,
  prefill graphs off with it);
- ``fused``: the engine's fused element-wise kernels on
  (``generator.inference_engine.fused_pointwise=true``);
- ``threads``: envs stepped on a thread per core (``generator.env_workers=0``);
- ``eager_vision``: each turn's vision tower run eagerly
  (``generator.inference_engine.vision_cuda_graphs=false``);
- ``dense_update``: the training forwards' attention under the dense visibility mask
  instead of FlexAttention (``trainer.flex_attention=false``);

and candidates the recipe does not set yet:

- ``whole_micro_batch``: one micro-batch a mini-batch (the recipe's 96 trajectories a pass,
  half the passes; with the dense mask it ran out of an H100's memory).

FlexAttention trains on CUDA alone: on another device every variant runs with it off.

Printed per variant: the mean seconds of a step and of its generate and update phases over
the steps after the first ``--warmup`` (which pay the start-up: the first step sizes the
KV cache by the first observations, the next by later ones, and each captures the CUDA
graphs of its shapes), GRPO steps per minute, the speed-up
over the first variant run, and the seconds its last evaluation took to play
``--eval-rows`` eval mazes greedily (the evaluation a run does every ``eval_interval``
steps; the variant evaluates every ``--warmup`` steps, and a step's time leaves its
evaluation out) and the timed steps' mean episode length in tokens (variants sample
different episodes from the random policy: their lengths say how much work each did); then the
floor of such a step (``bounds.grpo_step_floor``: its FLOPs at the card's measured matrix
rate, its decode's bytes at its bandwidth, for the last step's episode lengths).
``--profile DIR`` runs the first variant's last step under the
profilers and writes where its time went (``step_profile.py``).

    python benchmarks/recipe_steps.py --recipe recipes/easy-1gpu.yaml --steps 4
    python benchmarks/recipe_steps.py --steps 3 --variants after --profile runs/profile
    python benchmarks/recipe_steps.py --recipe recipes/cpu-demo.yaml --steps 2 --device cpu \\
        --set trainer.train_batch_size=2 trainer.policy_mini_batch_size=2 \\
        generator.n_samples_per_prompt=2 generator.max_turns=3 \\
        trainer.micro_train_batch_size_per_gpu=4 trainer.micro_forward_batch_size_per_gpu=4
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bounds import add_hardware_flags, grpo_step_floor, hardware, model_sizes  # noqa: E402
from step_profile import profiled_phases  # noqa: E402

from clew.config import ClewConfig, load_config  # noqa: E402
from clew.inference.runtime import pick_device  # noqa: E402
from clew.trainer.launch import run_dir_of, run_grpo  # noqa: E402
from clew.trainer.pipeline import run_pipeline, updated  # noqa: E402

VARIANTS: dict[str, dict[str, object]] = {
    "after": {},
    "padded_update": {"trainer.remove_microbatch_padding": False},
    "eager_prefill": {"generator.inference_engine.prefill_cuda_graphs": False},
    "eager": {"generator.inference_engine.enforce_eager": True},
    "fused": {"generator.inference_engine.fused_pointwise": True},
    "threads": {"generator.env_workers": 0},
    "eager_vision": {"generator.inference_engine.vision_cuda_graphs": False},
    "dense_update": {"trainer.flex_attention": False},
    "whole_micro_batch": {},  # its micro-batch sizes come from the recipe: _variant_keys
}


def _variant_keys(name: str, cfg: ClewConfig) -> dict[str, object]:
    """The overrides of variant ``name`` for the recipe ``cfg``."""
    if name == "whole_micro_batch":
        whole = cfg.trainer.policy_mini_batch_size * cfg.generator.n_samples_per_prompt
        return {
            "trainer.micro_train_batch_size_per_gpu": whole,
            "trainer.micro_forward_batch_size_per_gpu": whole,
        }
    return VARIANTS[name]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="recipes/easy-1gpu.yaml")
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each")
    p.add_argument("--device", default="auto")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides")
    p.add_argument(
        "--profile",
        type=Path,
        help="profile the last step of the first variant into this folder (step_profile.py)",
    )
    p.add_argument(
        "--eval-rows",
        type=int,
        default=64,
        help="eval mazes the final policy of each variant plays greedily (0: no evaluation)",
    )
    add_hardware_flags(p)
    args = p.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        base = [
            f"trainer.log_path={out}",
            f"trainer.device={args.device}",
            "pipeline.stages=[dataset,model]",
            f"pipeline.dataset.eval_rows={max(args.eval_rows, 1)}",
            "trainer.eval_before_train=false",
            # Every --warmup steps: the evaluation's own start-up (its cache, its graphs) is paid
            # before the last one, whose time is reported; a step's time leaves its out.
            f"trainer.eval_interval={max(args.warmup, 1) if args.eval_rows > 0 else -1}",
            "trainer.ckpt_interval=-1",
            "trainer.hf_save_interval=-1",
            "trainer.export_best=false",
            "trainer.resume_mode=none",
            "trainer.logger=jsonl",
            f"trainer.max_steps={args.steps}",
            *args.set,
        ]
        on_cuda = pick_device(args.device).type == "cuda"
        # FlexAttention has no backward on a CPU: elsewhere the recipe runs with it off.
        cfg = load_config(args.recipe, base + ([] if on_cuda else ["trainer.flex_attention=false"]))
        rows = cfg.trainer.train_batch_size * args.steps
        cfg = updated(cfg, {"pipeline.dataset.train_rows": rows})
        run_pipeline(cfg)
        model = out / "models" / "base"
        cfg = updated(
            cfg,
            {
                "data.train_data": [str(out / "data" / "train.parquet")],
                "data.val_data": [str(out / "data" / "eval.parquet")] if args.eval_rows else [],
                "trainer.policy.model.path": str(model),
            },
        )
        g, t = cfg.generator, cfg.trainer
        print(
            f"{args.recipe}: {t.train_batch_size} prompts x {g.n_samples_per_prompt} samples, "
            f"up to {g.max_turns} turns, {args.steps} steps per variant (the first "
            f"{args.warmup} untimed)"
        )
        print(
            f"{'variant':<10} {'step s':>7} {'generate':>9} {'update':>7} {'steps/min':>9} "
            f"{'speed-up':>8} {'eval s':>7} {'tokens':>7}"
        )
        first, heads = None, []
        for name in names:
            run_cfg = updated(cfg, {"trainer.run_name": name, **_variant_keys(name, cfg)})
            profiling = (
                profiled_phases(args.profile, args.steps)
                if args.profile and first is None
                else contextlib.nullcontext([])
            )
            with profiling as heads_of_run:
                run_grpo(run_cfg)
            heads += heads_of_run
            gc.collect()  # the last variant's policy and engine, before the next sizes its cache
            lines = (run_dir_of(run_cfg) / "metrics.jsonl").read_text().splitlines()
            logged = [json.loads(line) for line in lines]
            hist = [h for h in logged if "timing/step" in h]
            evals = [h["timing/evaluate"] for h in logged if "timing/evaluate" in h]
            timed = hist[args.warmup :] or hist
            step = statistics.mean(h["timing/step"] - h.get("timing/evaluate", 0.0) for h in timed)
            gen = statistics.mean(h["timing/generate"] for h in timed)
            upd = statistics.mean(h["timing/update"] for h in timed)
            first = first or step
            print(
                f"{name:<10} {step:>7.2f} {gen:>9.2f} {upd:>7.2f} {60 / step:>9.2f} "
                f"{first / step:>7.2f}x "
                + (f"{evals[-1]:>7.2f}" if evals else f"{'-':>7}")
                + f" {statistics.mean(h['train/episode_tokens_mean'] for h in timed):>7.0f}"
            )
            last = timed[-1]
        floor = grpo_step_floor(
            model_sizes(model),
            hardware(args),
            episodes=t.train_batch_size * g.n_samples_per_prompt,
            episode_tokens=last["train/episode_tokens_mean"],
            generated_tokens=last["train/generated_tokens_mean"],
            update_passes=t.update_epochs_per_batch,
        )
        print(
            f"{'floor':<10} {floor.step:>7.2f} {floor.generate:>9.2f} {floor.update:>7.2f} "
            f"{60 / floor.step:>9.0f}   (the FLOPs and bytes alone: bounds.grpo_step_floor)"
        )
        if heads:
            print(
                "\n".join(
                    ["", f"profile of step {args.steps} ({names[0]}), in {args.profile}:"] + heads
                )
            )


if __name__ == "__main__":
    main()
