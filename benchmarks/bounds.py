"""What the hardware allows: the floor of a phase from its FLOPs and bytes.

The benchmarks print each figure beside such a bound and the share of it reached. The
defaults are one H200's: 801 TFLOP/s of bfloat16 matrix rate (``--peak-tflops``; the
dense figure of its datasheet less what its matrix units reach on large GEMMs here) and
4.2 TB/s of memory bandwidth (``--bandwidth-tbs``; what a large copy reaches of its 4.8).

The arithmetic, for a model of ``N`` parameters (``model_sizes``):

- a forward over a token: ``2 N`` FLOPs (vision included for image tokens, as the patches
  go through the vision tower once); a training token, forward and backward: ``6 N`` over
  the language model (the usual MFU convention, LoRA or not);
- a decode step of ``B`` rows: the text weights read once plus each row's KV cache, so
  ``bytes(text weights) + B * cache_len * kv_bytes_per_token``.
"""

from __future__ import annotations

import argparse
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

    @property
    def text_weight_bytes(self) -> int:
        return 2 * self.text_params  # bfloat16


def model_sizes(model_dir: str | Path) -> ModelSizes:
    """Sizes of the policy saved in ``model_dir``, built on the meta device."""
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    seen: set[int] = set()
    total = vision = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if ".visual." in f".{name}":
            vision += p.numel()
    text = getattr(config, "text_config", config)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv = 2 * text.num_hidden_layers * heads * head_dim * 2
    return ModelSizes(total, total - vision, vision, kv)


@dataclass(frozen=True)
class Hardware:
    tflops: float = H200_TFLOPS
    tbs: float = H200_TBS

    def compute_s(self, flops: float) -> float:
        return flops / (self.tflops * 1e12)

    def memory_s(self, nbytes: float) -> float:
        return nbytes / (self.tbs * 1e12)


def add_hardware_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peak-tflops", type=float, default=H200_TFLOPS, help="matrix rate bound")
    p.add_argument("--bandwidth-tbs", type=float, default=H200_TBS, help="memory bandwidth bound")


def hardware(args: argparse.Namespace) -> Hardware:
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
