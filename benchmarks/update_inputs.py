"""The update's host work on a GRPO step's rollouts: images encoded, micro-batches laid out.

Before its first forward the update encodes every trajectory's images as the training
forward reads them (``PolicyForward.vision``), and before each micro-batch's forward it lays
the micro-batch out (``clew.train.model_batch.collate``). Both run on the host while the
device waits for the first forward. This script plays ``--prompts`` x ``--samples`` episodes
of ``--env`` as a training rollout plays them (each observation's frames kept,
``RolloutSettings.keep_frames``), with a policy built from scratch (the one-GPU maze recipe's
``medium`` preset and image geometry by default; its random replies make episodes of a
trained policy's length or longer), then times on the host:

- ``images`` (the baseline): every trajectory's images encoded from the images, what
  training does with trajectories that kept no frames (one that came from another process);
- ``kept frames``: the engine's frames read instead (``clew.train.model_batch.encode_vision``);
- ``collate``: the update's micro-batches of ``--micro-batch`` trajectories, sorted by length
  as the update sorts them, laid out with the kept frames.

Printed: milliseconds for the whole batch (median of ``--repeats``), the frames' speed-up,
and the largest difference of the pixels (0: the same bytes).

    python benchmarks/update_inputs.py
    python benchmarks/update_inputs.py --preset tiny --prompts 2 --samples 2 --repeats 1
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from clew.data.rows import generate_rows
from clew.envs.base import text_corpus
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat
from clew.rollout.loop import RolloutSettings, play
from clew.train.model_batch import collate, encode_vision

ACTIONS = ("up", "down", "left", "right", "stop")


def _median_ms(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--env", default="maze_2d/easy")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=32)
    p.add_argument("--image-size", type=int, default=140)
    p.add_argument("--micro-batch", type=int, default=48)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        built = build_model(
            args.preset,
            Path(tmp) / "model",
            corpus=text_corpus(),
            arch="qwen3_vl",
            image_size=args.image_size,
            patch_size=14,
            merge_size=1,
        )
        model, processor = load_policy(built.path)
    chat = ChatFormat(processor)
    options = {"cell_px": 14, "border_px": 7, "max_turns": args.max_turns}
    rows = generate_rows(args.env, args.prompts, env_options=options | {"action_format": "keyword"})
    settings = RolloutSettings(
        n_samples_per_prompt=args.samples,
        max_turns=args.max_turns,
        keep_last_k_images=1,
        reply_prefix="<action>",
        reply_suffix="</action>",
        env_workers=1,
        keep_frames=True,
        sampling=SamplingParams(temperature=1.5, max_tokens=1, allowed_tokens=ACTIONS),
    )
    with torch.no_grad():
        trajs = play(InferenceEngine(model.eval(), chat), rows, settings, seed=0)
    images = sum(len(t.images) for t in trajs)
    tokens = sum(len(t.token_ids) for t in trajs)
    print(
        f"{args.env}: {len(trajs)} episodes ({args.preset}, random replies), {images} frames, "
        f"{tokens} tokens; micro-batches of {args.micro_batch}; ms on the host, median of "
        f"{args.repeats}"
    )
    bare = [dataclasses.replace(t, frames=[]) for t in trajs]
    base_ms, base = _median_ms(lambda: [encode_vision(t, chat) for t in bare], args.repeats)
    kept_ms, kept = _median_ms(lambda: [encode_vision(t, chat) for t in trajs], args.repeats)
    diff = max(
        (a[0].data.int() - b[0].data.int()).abs().max().item()
        for a, b in zip(base, kept, strict=True)
        if a[0] is not None
    )
    order = sorted(range(len(trajs)), key=lambda i: len(trajs[i].token_ids))
    parts = [order[i : i + args.micro_batch] for i in range(0, len(order), args.micro_batch)]

    def lay_out() -> None:
        for idx in parts:
            collate([trajs[i] for i in idx], chat, vision=[kept[i] for i in idx])

    collate_ms, _ = _median_ms(lay_out, args.repeats)
    print(f"{'images (baseline)':>24} {base_ms:9.1f} ms")
    print(f"{'kept frames':>24} {kept_ms:9.1f} ms {base_ms / kept_ms:6.2f}x  pixel diff {diff}")
    print(f"{'collate':>24} {collate_ms:9.1f} ms  ({len(parts)} micro-batches)")


if __name__ == "__main__":
    main()
