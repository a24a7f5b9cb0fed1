"""SFT probe: build a tiny policy, SFT it on solver demonstrations, report greedy pass@1 as it trains.

    python experiments/sft_probe.py OUT STEPS BATCH LR DETOUR ENV_ID CELL_PX PRESET EVAL_EVERY ARCH [KEEP_K]
    python experiments/sft_probe.py /tmp/probe6 150 16 1e-3 0.0 maze_2d/room 14 tiny 50 qwen2_vl

Prints "EVAL step seconds pass@1 parse-error-rate mean-turns first-actions" lines.
BORDER=N in the environment draws the env's ``border_px`` frame (half a cell: the patches
fall across the cells' centres; BENCHMARKS.md, "Eighth attempt").
"""

import os
import sys
import time
from pathlib import Path

import torch

from clew.data.rows import generate_rows
from clew.envs.base import text_corpus
from clew.evaluation import eval_metrics
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import build_model
from clew.rollout.loop import RolloutSettings, play
from clew.train.sft import run_sft

torch.set_num_threads(2)
out = Path(sys.argv[1])
steps, bs, lr, detour = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
env_id = sys.argv[6]
cell = int(sys.argv[7])
preset = sys.argv[8] if len(sys.argv) > 8 else "tiny"
KEEP = int(sys.argv[11]) if len(sys.argv) > 11 else None
border = int(os.environ.get("BORDER", "0"))
opts = {"cell_px": cell, "border_px": border, "action_format": "keyword"}
build_model(
    preset,
    out / "base",
    corpus=text_corpus(),
    image_size=7 * cell + 2 * border,
    patch_size=cell,
    merge_size=1,
    overwrite=True,
    arch=sys.argv[10],
)
train = generate_rows(env_id, 3000, env_options=opts)
ev = generate_rows(env_id, 64, "eval", env_options=opts)
turns = ev[0].max_turns
t0 = time.time()


def eval_fn(model, chat, step):
    model.eval()
    trajs = play(
        InferenceEngine(model, chat),
        ev,
        RolloutSettings(
            1, turns, 4096, SamplingParams(temperature=0.0, max_tokens=8), keep_last_k_images=KEEP
        ),
        seed=0,
    )
    model.train()
    m = eval_metrics(trajs, ev, turns)
    print(
        "EVAL",
        step,
        round(time.time() - t0),
        m["eval/all/pass_at_1"],
        round(m["eval/all/parse_error_rate"], 3),
        round(m["eval/all/mean_turns"], 2),
        [t.actions[:3] for t in trajs[:1]],
        flush=True,
    )
    return m


run_sft(
    out / "base",
    train,
    out / "sft",
    steps=steps,
    batch_size=bs,
    lr=lr,
    detour_prob=detour,
    keep_last_k_images=KEEP,
    eval_fn=eval_fn,
    eval_interval=int(sys.argv[9]) if len(sys.argv) > 9 else 50,
    warmup_steps=10,
    log=lambda s, st: (
        print(
            s,
            round(time.time() - t0),
            round(st["sft/loss"], 3),
            round(st.get("sft/token_accuracy", 0), 3),
            flush=True,
        )
        if s % 25 == 0
        else None
    ),
)
