"""Decode steps of the engine under each set of its switches, in one run.

Each batch size gets a batch of text rows whose lengths spread evenly over
``--min-width``..``--max-width`` tokens (the shape of a 5-turn maze rollout's cache), one
engine batch per entry of ``--caches``, and ``--steps`` decode steps timed after a warm-up
(from the first decode step: the pending token's chunk before it is a prefill forward, as a
turn's is in a rollout); no row stops early (no stop token). ``static`` steps eagerly
(``generator.inference_engine.enforce_eager=true``), ``graphs`` replays the steps from CUDA
graphs (``enforce_eager=false``) with masked SDPA (``decode_attention=sdpa``), ``varlen``
the same with the variable-length kernel reading each row's own columns
(``decode_attention=varlen``; ``triton`` through clew's split-KV kernel,
``decode_attention=triton``), and ``fused`` is ``varlen`` with the rotary embedding and the
SwiGLU gate compiled into one kernel each (``generator.inference_engine.fused_pointwise=true``);
their captures (and compilations) are counted and their time left out of the step;
``triton+fused`` (an attention, then ``+fused``) combines them. Printed per entry and batch:
the decode step time, generated tokens/s, the bandwidth bound of a step (the text weights
read once plus every row's live KV cache, at ``--bandwidth-tbs``), the share of it reached,
and the speed-up over the first entry. ``--generate`` adds the re-encoding baseline on the
same rows: ``model.generate`` from the whole context (its prefill included, as a turn of
``benchmarks/rollout.py``'s ``baseline`` pays it). ``--kernels`` then plays ``--steps`` more
steps of each entry under ``torch.profiler`` (and the chunk before them apart, to take it
out) and prints where the device's time goes in a decode step: kernel time by kind (matrix
products, attention, norms, element-wise, copies, sampling), and the longest kernels by
name.

    python benchmarks/decode.py --preset tiny --batch 8,16 --min-width 40 --max-width 120 --steps 8
    python benchmarks/decode.py --preset qwen3vl-8b --device cuda --batch 96,192 --generate
    python benchmarks/decode.py --preset qwen3vl-8b --device cuda --batch 192 --caches varlen \
        --kernels
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

from clew.envs.base import text_corpus
from clew.inference.engine import InferenceEngine, kv_bytes_per_token
from clew.inference.sampling import SamplingParams
from clew.models import build_model
from clew.models.chat import ChatFormat, Chunk

sys.path.insert(0, str(Path(__file__).parent))
from bounds import add_hardware_flags, hardware  # noqa: E402
from kernel_kinds import kind_table, own_times  # noqa: E402

PREFILL_CHUNK = 256  # tokens a row per prefill forward, to bound the attention's memory


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _text_weight_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():
        if id(p) not in seen and ".visual." not in f".{name}":
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _rows(chat: ChatFormat, batch: int, lo: int, hi: int) -> list[list[int]]:
    words = chat.encode_text(" ".join(["left right up down stop wall"] * (hi // 4 + 1)))
    lengths = [lo + (hi - lo) * r // max(1, batch - 1) for r in range(batch)]
    return [words[:n] for n in lengths]


def _decode(
    engine: InferenceEngine, rows: list[list[int]], steps: int, warmup: int, kernels: bool = False
) -> dict:
    """Prefill ``rows`` in chunks, then time ``steps`` decode forwards (and, with ``kernels``,
    profile as many more)."""
    batch = engine.open_batch(len(rows), seed=0)
    one = SamplingParams(temperature=1.0, max_tokens=1)
    for start in range(0, max(map(len, rows)), PREFILL_CHUNK):
        batch.extend_and_generate(
            {i: Chunk(r[start : start + PREFILL_CHUNK]) for i, r in enumerate(rows)}, one
        )
    empty = {i: Chunk([]) for i in range(len(rows))}
    batch.extend_and_generate(empty, SamplingParams(temperature=1.0, max_tokens=warmup))
    # Room for the timed (and profiled) steps now: a growth of the cache is a copy, not a
    # step.
    batch.kv.reserve(batch.cache_tokens + (steps + 4) * (3 if kernels else 1))
    before = sum(batch.lengths)
    warm_capture_s = 0.0 if batch.graphs is None else batch.graphs.capture_s
    # The call's first forward is the pending token's one-token chunk, through the prefill
    # path (in a rollout, a turn's prefill); the clock starts at the first decode step. The
    # host has just read the chunk's sampled tokens then, so the sync waits for nothing.
    started: list[float] = []
    step = batch._step

    def first_step_starts_the_clock(*args, **kwargs):
        if not started:
            _sync(engine.device)
            started.append(time.perf_counter())
        return step(*args, **kwargs)

    batch._step = first_step_starts_the_clock
    try:
        batch.extend_and_generate(empty, SamplingParams(temperature=1.0, max_tokens=steps + 1))
        _sync(engine.device)
    finally:
        del batch._step
    seconds = time.perf_counter() - started[0]
    after = sum(batch.lengths)
    graphs = batch.graphs
    if graphs is not None:  # a capture inside the timed steps is not a step
        seconds -= graphs.capture_s - warm_capture_s
    return {
        "kernels": _kernel_profile(batch, empty, steps) if kernels else [],
        "captures": 0 if graphs is None else graphs.captures,
        "step_s": seconds / steps,
        "tokens_s": len(rows) * steps / seconds,
        "mean_cache": (before + after) / 2 / len(rows),
        "widths": (min(batch.lengths), max(batch.lengths)),
    }


def _kernel_profile(batch, empty: dict, steps: int) -> list[str]:
    """Where the device's time goes in a decode step: kernel time by kind and the longest
    kernels (replays of CUDA graphs included; on a CPU, operators' own time).

    Two calls are profiled, one that only prefills the pending token's chunk and one that
    also takes ``steps`` decode steps; the step is their difference, kernel by kernel."""
    from torch.profiler import ProfilerActivity, profile

    cuda = batch.engine.device.type == "cuda"

    def profiled(max_tokens: int) -> dict[str, list[float]]:
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as p:
            batch.extend_and_generate(empty, SamplingParams(temperature=1.0, max_tokens=max_tokens))
            _sync(batch.engine.device)
        return own_times(p, cuda)

    chunk, whole = profiled(1), profiled(steps + 1)
    for key, (us, count) in chunk.items():
        if key in whole:
            whole[key][0] -= us
            whole[key][1] -= count
    total = sum(us for us, count in whole.values() if count > 0 and us > 0)
    lines = [
        f"    device time a decode step: {total / steps / 1e3:.2f} ms (the chunk's forward "
        "profiled apart and taken out)"
    ]
    return lines + kind_table(whole, steps, "step")


def _generate(model, chat: ChatFormat, rows: list[list[int]], steps: int) -> dict:
    """``model.generate`` from the whole context, left-padded: a re-encoding turn."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), chat.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, width - len(row) :] = torch.tensor(row)
        mask[r, width - len(row) :] = 1
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            min_new_tokens=steps,
            max_new_tokens=steps,
            pad_token_id=chat.pad_id,
        )
    _sync(device)
    seconds = time.perf_counter() - t0
    return {"step_s": seconds / steps, "tokens_s": len(rows) * steps / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--arch", default=None, help="qwen2_vl or qwen3_vl (default: the preset's)")
    p.add_argument("--batch", default="96,192", help="batch sizes, comma-separated")
    p.add_argument("--min-width", type=int, default=180)
    p.add_argument("--max-width", type=int, default=775)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument(
        "--caches",
        default="static,graphs",
        help="or varlen, triton, fused; an attention with +fused (triton+fused) takes "
        "the fused kernels too; speed-ups are over the first",
    )
    p.add_argument("--generate", action="store_true", help="add the model.generate baseline")
    p.add_argument(
        "--kernels", action="store_true", help="profile each cache's steps: device time by kernel"
    )
    p.add_argument("--device", default="cpu")
    add_hardware_flags(p)
    args = p.parse_args()
    hardware(args)  # the bounds: measured on CUDA unless given (benchmarks/bounds.py)
    device = torch.device(args.device)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        built = build_model(
            args.preset,
            tmp,
            corpus=text_corpus(),
            arch=args.arch,
            device=args.device if device.type == "cuda" else None,
            overwrite=True,
        )
    model = built.model.to(device).eval()
    chat = ChatFormat(built.processor)
    weights = _text_weight_bytes(model)
    kv_token = kv_bytes_per_token(model)
    print(
        f"{args.preset} ({built.num_parameters / 1e6:,.1f}M parameters, text weights "
        f"{weights / 1e9:.3f} GB, KV {kv_token / 1e3:.1f} kB a token) on {device}; rows "
        f"{args.min_width}-{args.max_width} tokens, {args.steps} decode steps; bound at "
        f"{args.bandwidth_tbs} TB/s"
    )
    print(
        f"{'cache':<9} {'batch':>5} {'widths':>9} {'step ms':>8} {'gen tok/s':>10} "
        f"{'bound ms':>8} {'of bound':>8} {'vs first':>10}"
    )
    for size in (int(b) for b in args.batch.split(",")):
        rows = _rows(chat, size, args.min_width, args.max_width)
        results = {}
        for cache in args.caches.split(","):
            # No stop token, so every row decodes every step.
            attention, *extras = cache.split("+")
            if attention == "fused":  # on its own: the varlen attention's
                attention, extras = "varlen", [attention, *extras]
            if attention not in ("static", "graphs", "varlen", "triton"):
                p.error(f"--caches: no entry {cache!r}")
            graphs = attention != "static"
            engine = InferenceEngine(
                model,
                chat,
                stop_token_ids=(-1,),
                cuda_graphs=graphs,
                decode_attention="sdpa" if attention in ("graphs", "static") else attention,
                fused_pointwise="fused" in extras,
            )
            first = next(iter(results.values()), None)
            r = results[cache] = _decode(engine, rows, args.steps, args.warmup, args.kernels)
            bound_s = (weights + size * r["mean_cache"] * kv_token) / (args.bandwidth_tbs * 1e12)
            ratio = "" if first is None else f"{first['step_s'] / r['step_s']:.2f}x"
            print(
                f"{cache:<9} {size:>5} {r['widths'][0]:>4}-{r['widths'][1]:<4} "
                f"{r['step_s'] * 1e3:>8.2f} {r['tokens_s']:>10.0f} {bound_s * 1e3:>8.3f} "
                f"{bound_s / r['step_s']:>8.1%} {ratio:>10}"
                + (f"  ({r['captures']} graphs captured)" if graphs else "")
            )
            print("\n".join(r["kernels"]), end="\n" if r["kernels"] else "")
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if args.generate:
            g = _generate(model, chat, rows, args.steps)
            best = max(r["tokens_s"] for r in results.values())
            print(
                f"{'generate':<9} {size:>5} {'':>9} {g['step_s'] * 1e3:>8.2f} "
                f"{g['tokens_s']:>10.0f} {'':>8} {'':>8} {'':>10}  (engine: "
                f"{best / g['tokens_s']:.1f}x its tokens/s)"
            )


if __name__ == "__main__":
    main()
