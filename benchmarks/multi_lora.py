"""Decode steps of a batch mixing LoRA adapters against a batch running one, in one run.

Two random LoRA adapters (``--rank`` and ``--rank-b``, on every attention and MLP projection
of the language model, as clew trains them) are loaded into one engine
(``clew.inference.multi_lora``). Each batch size gets rows of ``--width`` tokens and, per
composition, a fresh engine batch and ``--steps`` decode steps timed after a warm-up; no row
stops early. Compositions: ``base`` (no row names an adapter: the wrapped layers add
nothing), ``single`` (every row runs adapter a) and ``mixed`` (rows take the base, a and b in
turn). ``single`` and ``mixed`` run once per strategy (``--strategies``: ``grouped`` picks
each adapter's rows and runs its own factors; ``gather`` copies every row's factors and runs
``bmm``). Printed: the decode step time, generated tokens/s, and the step time over the
``single`` batch of the same strategy and size.

    python benchmarks/multi_lora.py --preset tiny --batch 6,12 --width 32 --steps 8
    python benchmarks/multi_lora.py --preset qwen3vl-8b --device cuda --dtype bfloat16 \\
        --batch 48,96 --rank 16 --rank-b 32
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time

import torch

from clew.envs.base import text_corpus
from clew.inference.engine import InferenceEngine
from clew.inference.multi_lora import STRATEGIES
from clew.inference.sampling import SamplingParams
from clew.models import build_model
from clew.models.chat import ChatFormat, Chunk
from clew.train.lora import LANGUAGE_MODEL_TARGETS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_adapter(
    model: torch.nn.Module, rank: int, alpha: float, seed: int
) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter's config and tensors with random factors on the language model."""
    gen = torch.Generator().manual_seed(seed)
    target = re.compile(LANGUAGE_MODEL_TARGETS)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and target.fullmatch(name):
            key = f"base_model.model.{name}"
            a = torch.randn(rank, module.in_features, generator=gen) / module.in_features**0.5
            b = torch.randn(module.out_features, rank, generator=gen) * 0.01
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    return {"peft_type": "LORA", "r": rank, "lora_alpha": alpha}, tensors


def _decode(
    engine: InferenceEngine,
    adapters: list[str | None],
    rows: list[list[int]],
    steps: int,
    warmup: int,
) -> dict:
    """Prefill ``rows``, then time ``steps`` decode forwards of one token a row."""
    batch = engine.open_batch(len(rows), seed=0, adapters=adapters)
    batch.extend_and_generate(
        {i: Chunk(r) for i, r in enumerate(rows)}, SamplingParams(max_tokens=warmup)
    )
    empty = {i: Chunk([]) for i in range(len(rows))}
    # Room for the timed steps now: a growth of the cache is a copy, not a step.
    batch.kv.reserve(batch.cache_tokens + 1 + steps)
    _sync(engine.device)
    t0 = time.perf_counter()
    batch.extend_and_generate(empty, SamplingParams(max_tokens=steps))
    _sync(engine.device)
    seconds = time.perf_counter() - t0
    return {"step_s": seconds / steps, "tokens_s": len(rows) * steps / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--arch", default=None, help="qwen2_vl or qwen3_vl (default: the preset's)")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype",
        default=None,
        help="weights dtype (default: float32 on the CPU, bfloat16 on CUDA)",
    )
    p.add_argument("--batch", default="48,96", help="batch sizes, comma-separated")
    p.add_argument("--width", type=int, default=400, help="prompt tokens a row")
    p.add_argument("--rank", type=int, default=16, help="adapter a's rank")
    p.add_argument("--rank-b", type=int, default=32, help="adapter b's rank")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    args = p.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        built = build_model(
            args.preset,
            tmp,
            corpus=text_corpus(),
            arch=args.arch,
            dtype=args.dtype,
            device=args.device if device.type == "cuda" else None,
            overwrite=True,
        )
    model = built.model.to(device).eval()
    chat = ChatFormat(built.processor)
    engine = InferenceEngine(model, chat, stop_token_ids=(-1,))  # no row stops early
    engine.add_adapter("a", random_adapter(model, args.rank, 2.0 * args.rank, seed=1))
    engine.add_adapter("b", random_adapter(model, args.rank_b, 2.0 * args.rank_b, seed=2))
    words = chat.encode_text(" ".join(["left right up down stop wall"] * (args.width // 4 + 1)))
    print(
        f"{args.preset} ({built.num_parameters / 1e6:,.1f}M parameters, "
        f"{next(model.parameters()).dtype}) on {device}; adapters a (rank {args.rank}) and b "
        f"(rank {args.rank_b}); rows of {args.width} tokens, {args.steps} decode steps"
    )
    print(
        f"{'strategy':<8} {'batch':>5} {'rows':<7} {'step ms':>8} {'gen tok/s':>10} {'vs single':>9}"
    )
    for size in (int(b) for b in args.batch.split(",")):
        rows = [words[: args.width] for _ in range(size)]
        mixes = {
            "single": ["a"] * size,
            "mixed": [(None, "a", "b")[i % 3] for i in range(size)],
        }
        base = _decode(engine, [None] * size, rows, args.steps, args.warmup)
        print(
            f"{'-':<8} {size:>5} {'base':<7} {base['step_s'] * 1e3:>8.2f} "
            f"{base['tokens_s']:>10.0f} {'':>9}"
        )
        for strategy in args.strategies.split(","):
            engine.lora.strategy = strategy
            single = None
            for label, adapters in mixes.items():
                r = _decode(engine, adapters, rows, args.steps, args.warmup)
                single = single or r
                print(
                    f"{strategy:<8} {size:>5} {label:<7} {r['step_s'] * 1e3:>8.2f} "
                    f"{r['tokens_s']:>10.0f} {r['step_s'] / single['step_s']:>8.2f}x"
                )


if __name__ == "__main__":
    main()
