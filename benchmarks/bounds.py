"""What the hardware allows: the floor of a phase from its FLOPs and bytes.

The benchmarks print each figure beside such a bound and the share of it reached: the
bfloat16 matrix rate (``--peak-tflops``) and the memory bandwidth (``--bandwidth-tbs``) that
the card reaches, measured at the start of a run on CUDA (``measure_hardware``: a large
bfloat16 GEMM and a large copy, about a second) unless the flags give them. One H200
measured 801 TFLOP/s (its datasheet's dense figure is 989) and 4.2 TB/s (of 4.8); those are
the figures on a machine without CUDA, and the H200 figures in BENCHMARKS.md up to commit
f52c420 used them as constants.

The arithmetic, for a model of ``N`` parameters (``model_sizes``):

- a forward over a token: ``2 N`` FLOPs (vision included for image tokens, as the patches
  go through the vision tower once); a training token, forward and backward: ``6 N`` over
  the language model (the usual MFU convention, LoRA or not);
- a decode step of ``B`` rows: the text weights read once plus each row's KV cache, so
  ``bytes(text weights) + B * cache_len * kv_bytes_per_token``.

``2 N`` a token is the targets' convention for a prefill, and it leaves work out: the vision
tower runs once per patch (four a merged image token for Qwen-VL), not once per token, and
attention over the context adds ``4 L H D`` FLOPs per query-key pair (``L`` layers, ``H``
query heads of ``D``). ``ModelSizes.prefill_work`` counts those (and leaves out the
embedding lookups and the output layer, which a prefill runs for one token a row), for the
figure beside the convention's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

H200_TFLOPS = 801.0
H200_TBS = 4.2


@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts and bytes of a policy, from its config (nothing is allocated)."""

    params: int  # all of them, vision included
    text_params: int  # the language model with its embeddings and head
    vision_params: int
    kv_bytes_per_token: int  # every layer's keys and values of one token, in bfloat16
    text_body_params: int = 0  # the language model's layers: no embeddings, no output layer
    attention_flops_per_pair: int = 0  # 4 L H D: one query against one key, every layer

    def prefill_work(self, tokens: float, patches: float, pairs: float) -> float:
        """FLOPs of a prefill of ``tokens`` text-model tokens, ``patches`` vision patches and
        ``pairs`` query-key pairs of the language model's attention (module docstring)."""
        return (
            2 * self.text_body_params * tokens
            + 2 * self.vision_params * patches
            + self.attention_flops_per_pair * pairs
        )

    @property
    def text_weight_bytes(self) -> int:
        return 2 * self.text_params  # bfloat16


def model_sizes(model_dir: str | Path) -> ModelSizes:
    """Sizes of the policy saved in ``model_dir``, built on the meta device."""
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    seen: set[int] = set()
    total = vision = ends = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if ".visual." in f".{name}":
            vision += p.numel()
        elif "embed_tokens" in name or "lm_head" in name:
            ends += p.numel()
    text = getattr(config, "text_config", config)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv = 2 * text.num_hidden_layers * heads * head_dim * 2
    pair = 4 * text.num_hidden_layers * text.num_attention_heads * head_dim
    return ModelSizes(total, total - vision, vision, kv, total - vision - ends, pair)


@dataclass(frozen=True)
class Hardware:
    tflops: float = H200_TFLOPS
    tbs: float = H200_TBS

    def compute_s(self, flops: float) -> float:
        return flops / (self.tflops * 1e12)

    def memory_s(self, nbytes: float) -> float:
        return nbytes / (self.tbs * 1e12)


def add_hardware_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="matrix rate bound (default: measured)"
    )
    p.add_argument(
        "--bandwidth-tbs", type=float, default=None, help="bandwidth bound (default: measured)"
    )


def call_seconds(fn, device: torch.device, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones: between
    CUDA events on a GPU, by the host clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return times


def candidates_header(width: int) -> None:
    """The header of ``compare_candidates``'s lines."""
    print(
        f"{'candidate':<{width}} {'batch':>5} {'us':>9} {'bound us':>9} {'of bound':>8} "
        f"{'x layers ms':>11} {'vs base':>8} {'max diff':>9}"
    )


def compare_candidates(
    runs: dict[str, Callable[[], torch.Tensor]],
    names: list[str],
    baseline: str,
    *,
    batch: int,
    bound_s: float,
    layers: int,
    device: torch.device,
    repeats: int,
    width: int,
    pick: Callable[[torch.Tensor], torch.Tensor] = lambda out: out,
) -> None:
    """Time ``runs[name]`` for each of ``names`` (median of ``repeats`` calls) and print it
    beside ``bound_s``, times ``layers``, its speed-up over ``baseline`` (when that ran
    first) and its largest difference from the baseline's output (``pick`` of each); a
    candidate the device or torch build cannot run says why."""
    ref = pick(runs[baseline]()).float()
    base = None
    for name in names:
        try:
            diff = (pick(runs[name]()).float() - ref).abs().max().item()
            s = statistics.median(call_seconds(runs[name], device, repeats, warmup=3))
        except (RuntimeError, NotImplementedError) as error:
            print(f"{name:<{width}} {batch:>5}  unavailable: {str(error).splitlines()[0][:90]}")
            continue
        base = s if name == baseline else base
        speed = f"{base / s:.2f}x" if base else ""
        print(
            f"{name:<{width}} {batch:>5} {s * 1e6:>9.1f} {bound_s * 1e6:>9.1f} "
            f"{100 * bound_s / s:>7.1f}% {s * layers * 1e3:>11.2f} {speed:>8} {diff:>9.2e}"
        )


def measure_hardware(device: torch.device, n: int = 8192, copy_bytes: int = 2**30) -> Hardware:
    """The matrix rate of ``n``-square bfloat16 GEMMs and the bandwidth of a ``copy_bytes``
    device copy (read and write counted), each the best of a few timed repeats."""

    def best(fn) -> float:
        return min(call_seconds(fn, device, repeats=10))

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    tflops = 2 * n**3 / best(lambda: a @ b) / 1e12
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    tbs = 2 * copy_bytes / best(lambda: dst.copy_(src)) / 1e12
    return Hardware(round(tflops, 1), round(tbs, 3))


def hardware(args: argparse.Namespace) -> Hardware:
    """The bounds of this run: the flags where given, else measured on CUDA (once, and
    written back to ``args``), else the H200's figures."""
    if args.peak_tflops is None or args.bandwidth_tbs is None:
        if torch.cuda.is_available():
            measured = measure_hardware(torch.device("cuda"))
            print(
                f"measured on {torch.cuda.get_device_name()}: {measured.tflops:g} TFLOP/s of "
                f"bf16 GEMM, {measured.tbs:g} TB/s of copy"
            )
        else:
            measured = Hardware()
        args.peak_tflops = args.peak_tflops or measured.tflops
        args.bandwidth_tbs = args.bandwidth_tbs or measured.tbs
    return Hardware(args.peak_tflops, args.bandwidth_tbs)


@dataclass(frozen=True)
class StepFloor:
    """The floor of a GRPO step's phases, seconds."""

    prefill: float
    decode: float
    update: float

    @property
    def generate(self) -> float:
        return self.prefill + self.decode

    @property
    def step(self) -> float:
        return self.generate + self.update


def grpo_step_floor(
    sizes: ModelSizes,
    hw: Hardware,
    *,
    episodes: int,
    episode_tokens: float,
    generated_tokens: float,
    rows_per_wave: int | None = None,
    update_passes: float = 1.0,
) -> StepFloor:
    """The floor of one step whose ``episodes`` average ``episode_tokens`` tokens, of which
    ``generated_tokens`` sampled over ``turns`` turns.

    Prefill: every token that is not sampled is fed once (``2 N`` FLOPs). Decode: the rows
    of a wave (``rows_per_wave``, all by default) decode together, one step per sampled
    token of an episode (``generated_tokens`` steps over its ``turns``), each step reading
    the text weights once and every row's cache (half an episode long, on average).
    Update: ``6 N_text`` FLOPs per token, ``update_passes`` times (PPO epochs)."""
    fed = max(episode_tokens - generated_tokens, 0.0) * episodes
    prefill = hw.compute_s(2 * sizes.params * fed)
    rows = min(episodes, rows_per_wave or episodes)
    waves = -(-episodes // rows)
    kv = rows * (episode_tokens / 2) * sizes.kv_bytes_per_token
    decode = waves * generated_tokens * hw.memory_s(sizes.text_weight_bytes + kv)
    update = hw.compute_s(6 * sizes.text_params * episode_tokens * episodes * update_passes)
    return StepFloor(prefill, decode, update)
