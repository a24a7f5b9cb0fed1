"""Rollout throughput: clew's engine against the plain baseline, in one run.

The baseline is what a user would write without an engine: each turn, re-render the
whole conversation with the chat template, re-encode every image, and call
``model.generate`` on the batch (the KV cache is thrown away between turns). Both sides
play the same mazes with the same model, sampling settings and turn budget; a random
model's replies rarely end an episode early, so both do the same number of turns.

    python benchmarks/rollout.py --preset tiny --prompts 8 --samples 4 --max-turns 10
    python benchmarks/rollout.py --preset base --prompts 24 --samples 8 --max-turns 20 --device cuda
    python benchmarks/rollout.py --preset qwen3vl-8b --env-id maze_2d/easy --prompts 24 \
        --samples 8 --max-turns 5 --device cuda --profile

Each side plays a small warm-up first (one prompt, two samples, two turns), so compilations
that happen once a process are not counted; the graph captures of its batches are.
``--profile`` splits the engine's rollout into its prefill forwards, decode forwards, the
engine's own work around them (masks, positions, patch upload, sampling, compaction) and
what runs outside the engine (env steps, frame encoding, trajectories), each forward timed
between device synchronizations (which the plain run does not pay), and prints each beside
its bound (``benchmarks/bounds.py``): prefill at ``2 N`` FLOPs a token at the matrix rate,
a decode step reading the text weights and every live row's KV cache at the bandwidth. A
second prefill figure counts the work as it is: the vision tower per patch, attention per
query-key pair, no output layer.
The sides other than ``--defaults`` prefill with masked SDPA unless ``--prefill-varlen``
(the engine's default prefill is ``auto``: clew's Triton kernel on CUDA); ``--defaults`` adds a side with every engine
switch at its default, and ``--profile`` then profiles that side; ``--prefill-triton`` adds
one with the defaults but ``prefill_attention=triton``, which ``--profile`` then profiles;
``--profile`` prints how many images the vision tower ran on of those the prefill forwards
held (each distinct image of a forward runs once: ``clew.models.distinct_images``).
``--env-workers 1,0`` profiles once per ``generator.env_workers`` value: the env steps and
the encoding of the next observations in the loop's own thread, then on one thread per core.
``--frame-cache-mb 0,64`` profiles each of those with every frame resized, then with resized
frames kept by content (``clew.models.frame_cache``), and prints how many frames each resized.
``--prefill-kernels`` (with ``--profile``) plays the profiled side once more, each prefill
forward under ``torch.profiler``, and prints a forward's device time by kernel kind and its
longest kernels; beside the timings above, it shows how much of a prefill forward the
device sits idle. ``--profile`` also times the vision tower inside the prefill forwards.
``--trace FILE`` plays once more under ``torch.profiler`` (host, and device on CUDA; the
CUDA-graph side with ``--cuda-graphs``), prints the operators that took the most host time
(CUDA runtime calls such as ``cudaMalloc`` included) and, on CUDA, the kernels that took the
most device time, and writes a Chrome trace.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from clew.data.rows import generate_rows
from clew.envs.base import text_corpus
from clew.inference.runtime import open_policy
from clew.models import build_model
from clew.models.distinct_images import IMAGES
from clew.models.frame_cache import frame_cache
from clew.rollout.env_threads import env_threads

sys.path.insert(0, str(Path(__file__).parent))
from bounds import add_hardware_flags, hardware, model_sizes  # noqa: E402
from rollout_profile import EngineProfile  # noqa: E402
from rollout_sides import (  # noqa: E402
    ENV_WORKERS,
    attention_side,
    baseline,
    clew_side,
    defaults_side,
    graphs_side,
)


def _trace(policy, rows, args) -> None:
    """One more play under torch.profiler (host and, on CUDA, device activity)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = policy.engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    side = graphs_side if args.cuda_graphs else clew_side
    with profile(activities=activities, record_shapes=False) as prof:
        side(policy, rows, args.samples, args.max_turns, args.max_tokens)
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25))
    if cuda:  # where the GPU's own time goes, kernel by kernel (graph replays included)
        print(
            averages.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90)
        )
    prof.export_chrome_trace(args.trace)
    print(f"trace: {args.trace}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model", help="existing checkpoint instead of building --preset")
    p.add_argument("--env-id", default="maze_2d/small")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument(
        "--skip-eager",
        action="store_true",
        help="leave out the eager engine's side; speed-ups are then over the first side",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="add a side whose decode steps replay CUDA graphs (enforce_eager=false) with "
        "masked SDPA (decode_attention=sdpa); "
        "--profile then profiles that side (a step's graph captures counted in its decode)",
    )
    p.add_argument(
        "--varlen",
        action="store_true",
        help="add a CUDA-graph side with variable-length decode attention (decode_attention="
        "varlen); --profile then profiles that side",
    )
    p.add_argument(
        "--fused",
        action="store_true",
        help="add a graphs + varlen side with the rotary embedding and the SwiGLU gate "
        "compiled (fused_pointwise=true); --profile then profiles that side",
    )
    p.add_argument(
        "--prefill-varlen",
        action="store_true",
        help="add a graphs + varlen side (with --fused, fused) whose prefill reads each row's "
        "own columns (prefill_attention=varlen); --profile then profiles that side",
    )
    p.add_argument(
        "--triton",
        action="store_true",
        help="add a graphs side whose decode steps take clew's split-KV Triton kernel "
        "(decode_attention=triton; with --fused, fused; with --prefill-varlen, its prefill); "
        "--profile then profiles that side",
    )
    p.add_argument(
        "--defaults",
        action="store_true",
        help="add a graphs side with every engine switch at its default (what `clew train` "
        "runs; the other sides' prefill is masked SDPA unless --prefill-varlen); --profile "
        "then profiles that side",
    )
    p.add_argument(
        "--prefill-triton",
        action="store_true",
        help="add a side with the engine's defaults but clew's Triton prefill kernel "
        "(prefill_attention=triton); --profile then profiles that side",
    )
    p.add_argument("--profile", action="store_true", help="time the engine's parts (see above)")
    p.add_argument(
        "--prefill-kernels",
        action="store_true",
        help="with --profile, play the profiled side once more with each prefill forward under "
        "torch.profiler, and print its device time by kernel kind",
    )
    p.add_argument("--arch", default=None, help="qwen2_vl or qwen3_vl (default: the preset's)")
    p.add_argument(
        "--env-workers",
        default="0",
        help="generator.env_workers, comma-separated: --profile runs once per value "
        "(1: env steps and observation encoding in the loop's thread; 0: one thread per core)",
    )
    p.add_argument(
        "--frame-cache-mb",
        default="64",
        help="resized frames kept by content (clew.models.frame_cache), comma-separated MB: "
        "--profile runs once per value and env_workers value (0: every frame resized)",
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="play once more under torch.profiler: print the top operators by host time and "
        "write a Chrome trace (chrome://tracing, Perfetto) to FILE",
    )
    add_hardware_flags(p)
    args = p.parse_args()
    if args.prefill_kernels and not args.profile:
        p.error("--prefill-kernels profiles the --profile side: add --profile")
    hardware(args)  # the bounds: measured on CUDA unless given (benchmarks/bounds.py)
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    rows = generate_rows(
        args.env_id, args.prompts, env_options={"cell_px": 28, "action_format": "keyword"}
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = (
            args.model
            or build_model(
                args.preset,
                tmp,
                corpus=text_corpus(),
                device="cuda" if cuda else None,
                arch=args.arch,
                overwrite=True,
            ).path
        )
        sizes = model_sizes(path)
        policy = open_policy(path, device=args.device)
        sides = [] if args.skip_eager else [("clew engine", clew_side)]
        sides += [("clew cuda graphs", attention_side("sdpa"))] if args.cuda_graphs else []
        sides += [("clew graphs + varlen", attention_side("varlen"))] if args.varlen else []
        sides += [("clew varlen + fused", attention_side("varlen", True))] if args.fused else []
        prefill_side = attention_side("varlen", args.fused, "varlen")
        sides += [("clew varlen prefill", prefill_side)] if args.prefill_varlen else []
        prefill = "varlen" if args.prefill_varlen else "sdpa"
        triton_side = attention_side("triton", args.fused, prefill)
        sides += [("clew triton", triton_side)] if args.triton else []
        default_side = defaults_side(policy) if args.defaults else None
        # Before the defaults' side: a side run second must win against that order too.
        triton_prefill_side = defaults_side(policy, "triton") if args.prefill_triton else None
        sides += [("clew triton prefill", triton_prefill_side)] if triton_prefill_side else []
        sides += [("clew defaults", default_side)] if default_side else []
        sides += [] if args.skip_baseline else [("baseline generate", baseline)]
        print(
            f"{args.prompts} prompts x {args.samples} samples, up to {args.max_turns} turns, "
            f"{args.max_tokens} tokens/turn, {args.preset} on {policy.engine.device}"
        )
        print(
            f"{'side':<18} {'episodes/s':>10} {'env steps/s':>11} {'gen tok/s':>10} {'prefill tok/s':>13} {'seconds':>8}"
        )
        results = {}
        for name, fn in sides:
            # Each side's own warm-up (kernels, allocator; torch.compile's kernels for
            # fused_pointwise compile once a process, not once a rollout). CUDA graphs are
            # captured per batch, so a rollout's captures stay in its time.
            fn(policy, rows[:1], 2, 2, args.max_tokens)
            if policy.engine.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = fn(policy, rows, args.samples, args.max_turns, args.max_tokens)
            if policy.engine.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            results[name] = r["episodes"] / dt
            print(
                f"{name:<18} {r['episodes'] / dt:>10.2f} {r['steps'] / dt:>11.1f} "
                f"{r['gen'] / dt:>10.0f} {r['prefill'] / dt:>13.0f} {dt:>8.1f}"
            )
        eager = results.get("clew engine", next(iter(results.values())))
        for name, rate in results.items():
            if name not in ("clew engine", "baseline generate"):
                print(f"speed-up of {name[5:]} (episodes/s): {rate / eager:.2f}x")
        if "baseline generate" in results:
            print(f"speed-up (episodes/s): {eager / results['baseline generate']:.2f}x")
        workers = [int(w) for w in args.env_workers.split(",")]
        caches = [int(mb) for mb in args.frame_cache_mb.split(",")]
        for w, mb in [(w, mb) for w in workers for mb in caches] if args.profile else []:
            ENV_WORKERS[0] = w
            frame_cache.capacity_bytes = mb << 20
            frame_cache.clear()
            frame_cache.hits = frame_cache.misses = 0
            IMAGES.reset()
            print(f"env_workers={w} ({env_threads(w)} threads), frame cache {mb} MB:")
            prof = EngineProfile(policy.engine.device, policy.engine.chat.pad_id)
            side = attention_side("sdpa") if args.cuda_graphs else clew_side
            side = attention_side("varlen") if args.varlen else side
            side = attention_side("varlen", True) if args.fused else side
            side = prefill_side if args.prefill_varlen else side
            side = triton_side if args.triton else side
            side = default_side or side
            side = triton_prefill_side or side
            with prof.installed(policy.engine.model):
                t0 = time.perf_counter()
                side(policy, rows, args.samples, args.max_turns, args.max_tokens)
                prof._sync()
                total = time.perf_counter() - t0
            prof.report(total, sizes, hardware(args))
            print(f"frames resized: {frame_cache.misses}, from the cache: {frame_cache.hits}")
            if IMAGES.seen:
                print(f"images through the vision tower: {IMAGES.encoded} of {IMAGES.seen}")
        ENV_WORKERS[0] = workers[-1]
        frame_cache.capacity_bytes = caches[-1] << 20
        if args.prefill_kernels:
            prof = EngineProfile(policy.engine.device, policy.engine.chat.pad_id, kernels=True)
            with prof.installed():
                side(policy, rows, args.samples, args.max_turns, args.max_tokens)
            print("\n".join(prof.kernel_report()))
        if args.trace:
            _trace(policy, rows, args)


if __name__ == "__main__":
    main()
