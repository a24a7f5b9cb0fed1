"""A rollout batch with the reply's format sampled beside one with it forced.

Baseline: every reply token sampled (``<action>``, the word, ``</action>``, ``<|im_end|>``
for a well-formed keyword action), each a forward pass of the whole batch. Forced:
``reply_prefix='<action>'``, ``reply_suffix='</action>'`` and one sampled token a reply,
so a turn is one forward pass (``clew.rollout.loop``). Prints forward passes per turn,
wall time and turns per second for the same maze_2d/easy rows (14 px cells, 32 turns,
current frame only, temperature 0.7). ``--model`` takes a trained policy (well-formed
replies: four forwards a turn unforced); without it a tiny random policy is built
offline, which rambles to ``--max-tokens``.

    python benchmarks/forced_reply.py [--model DIR] [--prompts 4] [--samples 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from clew.data.rows import generate_rows
from clew.inference import engine as engine_module
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat
from clew.rollout.loop import RolloutSettings, play


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = Path(tmp) / "tiny"
            build_model(
                "tiny", model_dir, arch="qwen3_vl", image_size=126, patch_size=14, merge_size=1
            )
        model, processor = load_policy(model_dir, "float32", args.device)
    engine = InferenceEngine(model, ChatFormat(processor), autocast=args.device.startswith("cuda"))
    opts = {"cell_px": 14, "max_turns": 32, "action_format": "keyword"}
    rows = generate_rows("maze_2d/easy", args.prompts, "train", env_options=opts)
    sampled = RolloutSettings(
        args.samples, 32, 8192, SamplingParams(temperature=0.7, max_tokens=args.max_tokens), 1
    )
    forced = replace(
        sampled,
        sampling=replace(sampled.sampling, max_tokens=1),
        reply_prefix="<action>",
        reply_suffix="</action>",
    )
    counts = {"_forward": 0, "extend_and_generate": 0}
    for name in counts:
        original = getattr(engine_module.CacheBatch, name)

        def counted(self, *a, _name=name, _original=original, **kw):
            counts[_name] += 1
            return _original(self, *a, **kw)

        setattr(engine_module.CacheBatch, name, counted)
    play(engine, rows[:1], forced, seed=0)  # warm-up
    print(f"{args.prompts} x {args.samples} episodes of maze_2d/easy on {args.device}")
    for name, settings in (("format sampled (baseline)", sampled), ("format forced", forced)):
        counts.update({k: 0 for k in counts})
        t = time.perf_counter()
        trajs = play(engine, rows, settings, seed=0)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        turns = sum(x.turns for x in trajs)
        solved = sum(x.success for x in trajs)
        print(
            f"{name:26s} {counts['_forward'] / counts['extend_and_generate']:5.2f} forwards a "
            f"batch turn, {wall:6.2f} s, "
            f"{turns} turns, {turns / wall:6.1f} turns/s, {solved} solved"
        )


if __name__ == "__main__":
    main()
