"""Rollouts that see only the last image: hidden images dropped from the KV cache, or kept.

With ``generator.keep_last_k_images=1`` the engine hides every older image from attention.
Baseline: the hidden columns stay in the cache, masked (what the engine did before), so
every decode step still reads, concatenates and expands them. clew: ``CacheBatch._compact``
drops them once they are a quarter of the cache. Both sides play the same mazes with the
same random-init policy (small preset as Qwen3-VL, 126 px frames, one token per cell),
greedy, and must produce the same actions; a random policy uses the whole turn budget.

    python benchmarks/hidden_image_cache.py [--episodes 16] [--max-turns 32] [--device cpu]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import clew.inference.cache_batch as batch_module
import clew.inference.engine as engine_module
from clew.data.rows import generate_rows
from clew.envs.base import text_corpus
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat
from clew.rollout.loop import RolloutSettings, play


def run(engine: InferenceEngine, rows, settings: RolloutSettings, compact: bool):
    saved = batch_module._COMPACT_WHEN_VISIBLE_BELOW
    widths: list[int] = []
    original = engine_module.CacheBatch._forward

    def forward(cached, *args, **kwargs):
        widths.append(cached.cache_tokens)
        return original(cached, *args, **kwargs)

    batch_module._COMPACT_WHEN_VISIBLE_BELOW = saved if compact else 0.0
    engine_module.CacheBatch._forward = forward
    try:
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        trajs = play(engine, rows, settings, seed=0)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, trajs, max(widths)
    finally:
        batch_module._COMPACT_WHEN_VISIBLE_BELOW = saved
        engine_module.CacheBatch._forward = original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--max-turns", type=int, default=32)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    opts = {"cell_px": 14, "max_turns": args.max_turns, "action_format": "keyword"}
    rows = generate_rows("maze_2d/easy", args.episodes, "eval", env_options=opts)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(
            args.preset,
            Path(tmp) / "m",
            corpus=text_corpus(),
            image_size=126,
            patch_size=14,
            merge_size=1,
            arch="qwen3_vl",
            overwrite=True,
        )
        model, processor = load_policy(Path(tmp) / "m", "float32", args.device)
    engine = InferenceEngine(model, ChatFormat(processor))
    settings = RolloutSettings(
        1, args.max_turns, 8192, SamplingParams(temperature=0.0, max_tokens=8), 1
    )
    run(engine, rows[:2], settings, compact=True)  # warm-up
    results = {}
    for name, compact in (("baseline, hidden images kept", False), ("clew, dropped", True)):
        seconds, trajs, width = run(engine, rows, settings, compact)
        turns = sum(t.turns for t in trajs)
        results[name] = [t.actions for t in trajs]
        print(
            f"{name:30s} {seconds:7.2f} s  {turns} turns  {turns / seconds:6.1f} turns/s  "
            f"widest cache {width} tokens"
        )
    same = len({repr(a) for a in results.values()}) == 1
    print(f"same actions on both sides: {same}")


if __name__ == "__main__":
    main()
