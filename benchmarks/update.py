"""The PPO update, each update-path switch on and off, in one run: tokens/s, MFU, peak memory.

One policy is built once (``--preset``, optionally with a padded ``--vocab-size`` such as
Qwen's 151,936) and wrapped once for training (LoRA ``--lora-rank``); every configuration
then runs the same PPO update on the same episodes, with only the worker's update-path
settings changed between them (``clew.train.settings.WorkerSettings``):

- ``plain``: padded micro-batches of ``--micro-batch`` episodes, whole logits (the baseline);
- ``remove_padding`` (``trainer.remove_microbatch_padding``): each micro-batch one packed
  row, attention within each episode;
- ``token_budget`` (``trainer.max_tokens_per_microbatch``, ``--budget`` tokens, padding
  counted) and ``packed_budget`` (the same with ``remove_padding``);
- ``chunked`` (``trainer.logprobs_chunk_size``, ``--chunk`` tokens);
- ``checkpointing`` (``trainer.gradient_checkpointing``);
- ``all``: every switch on;
- ``peft_lora``: ``packed_budget`` with peft's own LoRA forward instead of clew's fused one
  (``clew.kernels.fused_lora``), to show what the fusion buys.

The episodes are expert demonstrations of ``--env`` (images and replies laid out as the
rollout engine lays them out), ``--prompts`` of them each repeated ``--samples`` times as
GRPO's groups are, with random advantages; the learning rate is 0, so every configuration
updates the same weights. Printed per configuration: seconds per update (after
``--warmup`` untimed ones), training tokens/s (the episodes' own tokens, padding not
counted), MFU, peak memory on CUDA, the speed-up over ``plain`` and the largest difference
of the logprobs it scores from ``plain``'s (a correctness check at this size).

MFU is ``6 N`` FLOPs per training token over the language model's parameters (embeddings
and output projection included, the vision tower not: its forward runs once per image and
it is frozen), the usual convention whether or not the frozen weights get gradients (LoRA),
divided by ``--peak-tflops`` (``benchmarks/bounds.py``). ``HFU`` counts the matmul FLOPs
the update really does instead: with LoRA the frozen base computes no weight gradients
(``4 N`` a token, not ``6 N``), and activation checkpointing runs the forward twice.
``--trace`` profiles one more update and prints the kernels that took the most time. ``MFU+attn`` adds the causal
attention's matmuls, ``6 * layers * heads * head_dim * n**2`` per episode of ``n`` tokens
(forward and backward of ``Q K^T`` and ``P V`` over half the context on average). The
issue's target is an MFU of 0.45 with the real vocabulary.

    python benchmarks/update.py --preset qwen3vl-8b --vocab-size 151936 --device cuda
    python benchmarks/update.py --preset tiny --env maze_2d/tiny --prompts 2 --samples 2 --steps 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bounds import add_hardware_flags, hardware, model_sizes  # noqa: E402

from clew.data.rows import generate_rows  # noqa: E402
from clew.envs.base import text_corpus  # noqa: E402
from clew.kernels.fused_lora import fuse_lora  # noqa: E402
from clew.models import build_model  # noqa: E402
from clew.models.chat import ChatFormat  # noqa: E402
from clew.train import PolicyWorker, PPOSettings, WorkerSettings  # noqa: E402
from clew.train.training_batch import TrainingBatch  # noqa: E402
from clew.trainer.demonstrations import demonstrations  # noqa: E402

CONFIGS = (
    "plain",
    "remove_padding",
    "token_budget",
    "packed_budget",
    "chunked",
    "checkpointing",
    "all",
    "peft_lora",
)


def switches(name: str, args: argparse.Namespace) -> dict:
    """The worker settings of configuration ``name``."""
    budget = {"max_tokens_per_microbatch": args.budget}
    table = {
        "plain": {},
        "remove_padding": {"remove_padding": True},
        "token_budget": budget,
        "packed_budget": {"remove_padding": True, **budget},
        "chunked": {"logprobs_chunk_size": args.chunk},
        "checkpointing": {"gradient_checkpointing": True},
        "all": {
            "remove_padding": True,
            **budget,
            "logprobs_chunk_size": args.chunk,
            "gradient_checkpointing": True,
        },
        "peft_lora": {"remove_padding": True, **budget, "fused_lora": False},
    }
    if name not in table:
        raise SystemExit(f"unknown configuration {name!r}; accepted: {', '.join(table)}")
    return table[name]


def configure(worker: PolicyWorker, base: WorkerSettings, changes: dict) -> None:
    """Give the built worker ``changes`` on top of ``base``: the update-path settings are
    read at every forward; gradient checkpointing is a switch on the model."""
    changes = dict(changes)
    fuse_lora(worker.model, changes.pop("fused_lora", True))
    worker.settings = replace(base, **changes)
    model = (
        worker.model.get_base_model() if hasattr(worker.model, "get_base_model") else worker.model
    )
    on = changes.get("gradient_checkpointing", False)
    if on:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attention_flops(config: object, lengths: list[int]) -> float:
    """Training FLOPs of causal attention's matmuls over episodes of ``lengths`` tokens."""
    text = getattr(config, "text_config", config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    width = text.num_attention_heads * head_dim
    return 6.0 * text.num_hidden_layers * width * sum(n * n for n in lengths)


def _timed(worker, episodes, batch, settings, args, reference):
    """Seconds per update after the warm-up, the largest logprob difference from
    ``reference`` (the first configuration's) and that reference."""
    device = next(worker.model.parameters()).device
    logprobs = worker.compute_logprobs(episodes, micro_batch_size=args.micro_batch)
    if reference is None:
        reference = logprobs
    drift = max((a - b).abs().max().item() for a, b in zip(logprobs, reference, strict=True))
    for _ in range(args.warmup):
        worker.train_batch(batch, settings)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        worker.train_batch(batch, settings)
    _sync(device)
    return (time.perf_counter() - t0) / args.steps, drift, reference


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--arch", default=None, help="qwen2_vl or qwen3_vl (default: the preset's)")
    p.add_argument("--vocab-size", type=int, default=None, help="pad the vocabulary to this")
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--env", default="maze_2d/easy")
    p.add_argument(
        "--max-turns",
        type=int,
        default=13,
        help="turn budget (maze_2d/easy: 13 fits its shortest solver paths)",
    )
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--samples", type=int, default=8, help="copies of each episode (a group)")
    p.add_argument("--mini-batch", type=int, default=96, help="episodes per optimizer step")
    p.add_argument("--micro-batch", type=int, default=8, help="episodes per pass (plain)")
    p.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch")
    p.add_argument("--chunk", type=int, default=1024, help="tokens per logprob chunk")
    p.add_argument("--lora-rank", type=int, default=32, help="0: full fine-tuning")
    p.add_argument("--kl", action="store_true", help="add the KL term (reference scoring)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=1, help="timed updates per configuration")
    p.add_argument(
        "--trace",
        action="store_true",
        help="one more update of the last configuration under torch.profiler: the kernels "
        "that took the most device time (CUDA) or host time",
    )
    add_hardware_flags(p)
    args = p.parse_args()
    hardware(args)  # the bounds: measured on CUDA unless given (benchmarks/bounds.py)
    device = torch.device(args.device)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        built = build_model(
            args.preset,
            Path(tmp) / "model",
            corpus=text_corpus(),
            arch=args.arch,
            padded_vocab_size=args.vocab_size,
            image_size=args.image_size,
            device=args.device if device.type == "cuda" else None,
            overwrite=True,
        )
        sizes = model_sizes(built.path)
    model = built.model.to(device)
    chat = ChatFormat(built.processor)
    cuda_bf16 = device.type == "cuda" and next(model.parameters()).dtype == torch.bfloat16
    base = WorkerSettings(
        lr=0.0,
        lora_rank=args.lora_rank,
        lora_alpha=float(max(args.lora_rank, 1)),
        kl_reference=args.kl,
        autocast_bf16=cuda_bf16,
    )
    worker = PolicyWorker(model, chat, base)

    # Rows whose solver path fits the turn budget (a 9x9 maze's rarely fit 5 turns: draw more).
    drawn = generate_rows(args.env, 50 * args.prompts, env_options={"max_turns": args.max_turns})
    rows = [r for r in drawn if json.loads(r.metadata).get("turns_needed", 0) <= args.max_turns]
    rows = rows[: args.prompts]
    # Starts the budget still reaches the goal from: every row gives an episode.
    demos = demonstrations(rows, chat, seed=0, start_anywhere=1.0)
    episodes = [d for d in demos for _ in range(args.samples)]
    if not episodes:
        raise SystemExit(f"no demonstration of {args.env} fits {args.max_turns} turns")
    old = worker.compute_logprobs(episodes, micro_batch_size=args.micro_batch)
    advantages = torch.randn(len(episodes), generator=torch.Generator().manual_seed(0))
    batch = TrainingBatch(episodes, advantages, old)
    settings = PPOSettings(
        mini_batch_size=min(args.mini_batch, len(episodes)),
        micro_batch_size=args.micro_batch,
        forward_micro_batch_size=args.micro_batch,
        use_kl_loss=args.kl,
        kl_loss_coef=0.01 if args.kl else 0.0,
    )
    lengths = [len(e.token_ids) for e in episodes]
    tokens = sum(lengths)
    model_flops = 6.0 * sizes.text_params * tokens
    attn_flops = attention_flops(model.config, lengths)
    peak = args.peak_tflops * 1e12
    print(
        f"{args.preset}: {sizes.params / 1e9:.3f}B parameters ({sizes.text_params / 1e9:.3f}B "
        f"language model), vocabulary {model.config.get_text_config().vocab_size:,}, LoRA rank "
        f"{args.lora_rank}, on {device}; {len(episodes)} episodes of {min(lengths)}-"
        f"{max(lengths)} tokens ({tokens:,} in all, "
        f"{sum(sum(e.loss_mask[1:]) for e in episodes):,} trained), mini-batches of "
        f"{settings.mini_batch_size}; bound {args.peak_tflops:.0f} TFLOP/s"
    )
    print(
        f"{'config':<15} {'s/update':>9} {'tok/s':>9} {'MFU':>6} {'MFU+attn':>8} {'HFU':>6} "
        f"{'peak GB':>8} {'vs plain':>8} {'|dlogp| max':>11}"
    )
    reference: list[torch.Tensor] | None = None
    plain_s = None
    for name in args.configs.split(","):
        configure(worker, base, switches(name, args))
        try:
            seconds, drift, reference = _timed(worker, episodes, batch, settings, args, reference)
        except torch.OutOfMemoryError:
            # One configuration past the device's memory (the plain path's whole logits at
            # Qwen's vocabulary) is a figure too; the others still run.
            worker.model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            print(f"{name:<15} {'out of memory':>9}")
            continue
        plain_s = plain_s or seconds
        memory = (
            f"{torch.cuda.max_memory_allocated(device) / 1e9:>8.1f}"
            if device.type == "cuda"
            else f"{'-':>8}"
        )
        done = hardware_flops(sizes.text_params, tokens, attn_flops, args.lora_rank > 0, name)
        print(
            f"{name:<15} {seconds:>9.3f} {tokens / seconds:>9.0f} "
            f"{model_flops / seconds / peak:>6.3f} {(model_flops + attn_flops) / seconds / peak:>8.3f} "
            f"{done / seconds / peak:>6.3f} {memory} {plain_s / seconds:>7.2f}x {drift:>11.2e}"
        )
    print("target: MFU >= 0.45 with the real vocabulary (--vocab-size 151936)")
    if args.trace:
        _trace(worker, batch, settings, device)


def hardware_flops(params: int, tokens: int, attn: float, lora: bool, config: str) -> float:
    """The matmul FLOPs an update does (``HFU``'s numerator): forward ``2 N``, the backward's
    input gradients ``2 N`` and, without LoRA, its weight gradients ``2 N`` a token; with
    activation checkpointing the forward once more; the attention's matmuls likewise."""
    passes = 2 if lora else 3  # a frozen base has no weight gradients to compute
    checkpointing = config in ("checkpointing", "all")
    # Attention has no weights: its backward is twice its forward either way (``attn`` counts
    # both), plus the recomputed forward under checkpointing.
    return (2 * passes + 2 * checkpointing) * params * tokens + attn * (3 + checkpointing) / 3


def _trace(worker, batch, settings, device: torch.device) -> None:
    """One update under torch.profiler: where its time goes, kernel by kernel."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        worker.train_batch(batch, settings)
        _sync(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=90))


if __name__ == "__main__":
    main()
