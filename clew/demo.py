"""The main job a newcomer runs first (``make demo``): the whole pipeline on one CPU.

Datasets, a policy built offline, SFT from solver demonstrations, GRPO from the SFT
checkpoint, evaluation of both on the same fixed eval mazes, a report (plot and GIF).

The task is ``maze_2d/room`` (7x7 grid, open room, start and goal anywhere inside) with
14 px cells and a Qwen3-VL policy whose vision patch is one cell (``patch_size=14``,
``merge_size=1``: one vision token per cell) and that sees the current frame only
(``keep_last_k_images=1``, in SFT and GRPO alike). Why not ``maze_2d/easy``: learning
mazes from pixels takes hundreds of thousands of samples, hours on two CPU cores, while
the room keeps the visual skill (find yourself and the goal in the picture, move, reach the
goal) and drops the path planning. The GPU recipe (``recipes/easy-1gpu.yaml``) trains on
``maze_2d/easy`` itself.

The defaults are the measured recipe of BENCHMARKS.md ("The CPU main job"): a short SFT
(150 steps) leaves a policy whose greedy play often loops into a wall while its sampled
play solves about a third of the mazes; GRPO at the seed's sampling temperature (0.7),
with two optimizer steps per batch, turns that into greedy solves.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from clew.data.rows import dataset_stats, format_stats, generate_rows, write_rows


@dataclass(frozen=True)
class DemoPlan:
    env_id: str = "maze_2d/room"
    cell_px: int = 14
    train_rows: int = 2048
    eval_rows: int = 64
    preset: str = "tiny"
    arch: str = "qwen3_vl"
    # The base policy's pixel normalization (None: the architecture's) and vision position
    # table at start (`clew init-model --image-mean/--image-std/--position-table`).
    image_mean: tuple[float, float, float] | None = None
    image_std: tuple[float, float, float] | None = None
    position_table: str = "sincos"
    # The policy sees the current image only (generator.keep_last_k_images), in SFT and GRPO.
    keep_last_k_images: int | None = 1
    sft_steps: int = 150
    sft_batch_size: int = 16
    sft_lr: float = 1e-3
    sft_detour_prob: float = 0.0
    grpo_steps: int = 60
    grpo_prompts: int = 8
    # Mini-batches of 4 prompts: two optimizer steps per batch of rollouts (the seed's ratio,
    # 24 prompts in mini-batches of 12), with PPO's clipped ratio on the second.
    grpo_mini_batch: int = 4
    grpo_samples: int = 8
    grpo_lr: float = 2e-4
    # The learning rate decays along a cosine to zero at the last step, so the last steps
    # move the policy least: 2 of 4 seeds kept a 15-point gain to the end, against 1 of 4
    # at a constant rate (BENCHMARKS.md, "The CPU main job").
    grpo_scheduler: Literal["constant_with_warmup", "cosine", "linear"] = "cosine"
    # Sampling temperature of GRPO's rollouts (the seed's 0.7); evaluation is greedy.
    grpo_temperature: float = 0.7
    loss_reduction: str = "sequence_mean"
    extra_overrides: tuple[str, ...] = ()
    seed: int = 0


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_demo(output_dir: str | Path, plan: DemoPlan = DemoPlan()) -> dict[str, float]:
    """The whole main job: datasets, base policy, SFT, GRPO, report; returns the summary."""
    out = Path(output_dir)
    rows = make_datasets(out, plan)
    sft_dir = make_sft_start(out, plan, rows)
    return grpo_from(out, plan, rows, sft_dir)


def make_datasets(out: Path, plan: DemoPlan) -> dict[str, list]:
    """Writes ``out/data/{train,eval}.parquet`` and returns their rows."""
    opts = {"cell_px": plan.cell_px, "action_format": "keyword"}
    data = out / "data"
    rows = {}
    for split, n in (("train", plan.train_rows), ("eval", plan.eval_rows)):
        rows[split] = generate_rows(plan.env_id, n, split, env_options=opts)
        write_rows(rows[split], data / f"{split}.parquet")
        _say(
            f"{split} set: {data / f'{split}.parquet'}\n{format_stats(dataset_stats(rows[split]))}"
        )
    return rows


def make_sft_start(out: Path, plan: DemoPlan, rows: dict[str, list]) -> Path:
    """Builds the base policy offline and SFTs it on solver demonstrations: GRPO's start."""
    from clew.envs.base import text_corpus
    from clew.models import build_model
    from clew.train.sft import run_sft

    side = rows["train"][0].options()["grid_size"] * plan.cell_px
    base = build_model(
        plan.preset,
        out / "models" / "base",
        corpus=text_corpus(),
        seed=plan.seed,
        image_size=side,
        patch_size=plan.cell_px,
        merge_size=1,
        arch=plan.arch,
        image_mean=plan.image_mean,
        image_std=plan.image_std,
        position_table=plan.position_table,
        overwrite=True,
    )
    _say(f"built the {plan.preset} policy ({base.num_parameters:,} parameters) at {base.path}")

    _say(f"SFT: {plan.sft_steps} steps of {plan.sft_batch_size} solver episodes")
    sft_dir = out / "models" / "sft"
    run_sft(
        base.path,
        rows["train"],
        sft_dir,
        steps=plan.sft_steps,
        batch_size=plan.sft_batch_size,
        lr=plan.sft_lr,
        warmup_steps=10,
        detour_prob=plan.sft_detour_prob,
        keep_last_k_images=plan.keep_last_k_images,
        seed=plan.seed,
        log=lambda step, s: (
            _say(f"sft step {step} loss {s['sft/loss']:.3f}") if step % 25 == 0 else None
        ),
    )
    return sft_dir


def grpo_from(
    out: Path, plan: DemoPlan, rows: dict[str, list], sft_dir: Path, run_name: str = "grpo"
) -> dict[str, float]:
    """GRPO from ``sft_dir``, evaluated before training and after; writes the report."""
    from clew.config import load_config
    from clew.launch import run_dir_of, run_grpo
    from clew.metrics import draw_report

    data = out / "data"
    turns = rows["eval"][0].max_turns
    overrides = [
        f"data.train_data=['{data / 'train.parquet'}']",
        f"data.val_data=['{data / 'eval.parquet'}']",
        f"trainer.policy.model.path={sft_dir}",
        f"trainer.log_path={out / 'runs'}",
        f"trainer.run_name={run_name}",
        "trainer.logger=['console','tensorboard']",
        f"trainer.train_batch_size={plan.grpo_prompts}",
        f"trainer.policy_mini_batch_size={plan.grpo_mini_batch}",
        # 16 sequences per forward: CPU attention with a mask materialises its scores,
        # so larger micro-batches cost gigabytes for little speed.
        "trainer.micro_train_batch_size_per_gpu=16",
        "trainer.micro_forward_batch_size_per_gpu=16",
        f"trainer.epochs={max(1, plan.grpo_steps * plan.grpo_prompts // plan.train_rows + 1)}",
        f"trainer.eval_interval={max(plan.grpo_steps // 4, 1)}",
        "trainer.eval_before_train=true",
        f"trainer.ckpt_interval={plan.grpo_steps}",
        f"trainer.hf_save_interval={plan.grpo_steps}",
        "trainer.resume_mode=none",
        f"trainer.max_steps={plan.grpo_steps}",
        f"trainer.seed={plan.seed}",
        f"trainer.policy.optimizer_config.lr={plan.grpo_lr}",
        f"trainer.policy.optimizer_config.scheduler={plan.grpo_scheduler}",
        f"trainer.algorithm.loss_reduction={plan.loss_reduction}",
        "trainer.policy.optimizer_config.weight_decay=0.0",
        f"generator.n_samples_per_prompt={plan.grpo_samples}",
        f"generator.max_turns={turns}",
        f"generator.sampling_params.temperature={plan.grpo_temperature}",
        "generator.sampling_params.max_generate_length=8",
        "generator.max_input_length=2048",
        "trainer.max_prompt_length=512",
    ]
    if plan.keep_last_k_images is not None:
        overrides.append(f"generator.keep_last_k_images={plan.keep_last_k_images}")
    cfg = load_config(None, [*overrides, *plan.extra_overrides])
    _say(
        f"GRPO: {plan.grpo_steps} steps of {plan.grpo_prompts} mazes x {plan.grpo_samples} samples"
    )
    run_dir = run_dir_of(cfg)
    run_grpo(cfg)
    history = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(h["step"], h["eval/all/pass_at_1"]) for h in history if "eval/all/pass_at_1" in h]
    png = draw_report(run_dir)
    start, final = evals[0][1], evals[-1][1]
    gifs = sorted(
        (run_dir / "exports" / "eval").glob(f"global_step_{evals[-1][0]}/gifs/solved*.gif")
    )
    best_step, best = max(evals, key=lambda e: (e[1], -e[0]))  # ties: the earlier step
    summary = {
        "sft_pass_at_1": start,
        "final_pass_at_1": final,
        "gain_points": 100 * (final - start),
        "best_pass_at_1": best,
        "best_step": best_step,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _say(
        f"eval pass@1 on {len(rows['eval'])} fixed {plan.env_id} mazes: SFT start {start:.1%}, "
        f"after GRPO {final:.1%} ({summary['gain_points']:+.1f} points)"
    )
    if best_step != evals[-1][0]:
        kept = run_dir / "exports" / "best" / "policy"
        _say(
            f"best evaluation: {best:.1%} at step {best_step}"
            + (f", kept as {kept}" if kept.is_dir() else "")
        )
    _say(f"report: {png}" + (f"; a solved maze: {gifs[0]}" if gifs else ""))
    return summary
