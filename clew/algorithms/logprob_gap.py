"""How far the engine's sampling logprobs are from the trainer's, and the TIS correction.

The engine samples with its own kernels (a KV cache, merged LoRA weights, bfloat16, CUDA
graphs); the trainer scores the same tokens with its own forward. In exact arithmetic the
two agree; in practice each speed-up moves them apart, and PPO's first-step ratio, meant to
be exactly 1, is then off by the gap. ``LogprobGap`` measures it per token over the loss
mask (mean and largest absolute difference, and the share of tokens past
``LOGPROB_DIFF_THRESHOLD``), accumulated over micro-batches and, through a sum over workers,
over a data-parallel group.

``tis_weights`` is truncated importance sampling (Yao et al., "Your efficient RL framework
secretly brings you off-policy RL training", 2025), SkyRL's ``use_tis``: each token's
policy loss is multiplied by ``min(exp(old - rollout), cap)``, where ``old`` are the
trainer's logprobs (the PPO "old" policy) and ``rollout`` the engine's, so the gradient
estimate is that of the trainer's policy although the engine's drew the samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from clew.algorithms.stats import upcast_float

__all__ = ["LOGPROB_DIFF_THRESHOLD", "TIS_LOG_RATIO_CLAMP", "LogprobGap", "tis_weights"]

# |trainer - engine| past this counts as a token the engine got materially wrong: its
# first-step PPO ratio is off by more than 10%, half the usual clip range of 0.2.
LOGPROB_DIFF_THRESHOLD = 0.1

# As SkyRL's _safe_exp_delta: the log-ratio is clamped before exp so that one corrupted
# logprob cannot overflow to inf (the cap bounds it from above anyway; this bounds below).
TIS_LOG_RATIO_CLAMP = 20.0


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> Tensor:
    """Per-token ``min(exp(old_logprobs - rollout_logprobs), cap)``, float32, no gradient.

    ``old_logprobs`` are the trainer's, ``rollout_logprobs`` the engine's, on the same
    tokens (any equal shapes); ``cap`` > 0.
    """
    if cap <= 0:
        raise ValueError(f"the TIS ratio cap must be > 0, got {cap}")
    if old_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(
            f"old and rollout logprobs differ in shape: {tuple(old_logprobs.shape)} and "
            f"{tuple(rollout_logprobs.shape)}"
        )
    log_ratio = upcast_float(old_logprobs.detach()) - upcast_float(rollout_logprobs.detach())
    ratio = log_ratio.clamp(-TIS_LOG_RATIO_CLAMP, TIS_LOG_RATIO_CLAMP).exp()
    return ratio.clamp(max=cap)


@dataclass
class LogprobGap:
    """Running statistics of ``|trainer - engine|`` over the tokens added so far."""

    abs_sum: float = 0.0
    tokens: float = 0.0
    over: float = 0.0
    largest: float = 0.0
    threshold: float = LOGPROB_DIFF_THRESHOLD

    @torch.no_grad()
    def add(self, trainer: Tensor, engine: Tensor, mask: Tensor) -> None:
        """Count the tokens where ``mask`` is non-zero (any equal shapes, any devices)."""
        if not trainer.shape == engine.shape == mask.shape:
            raise ValueError(
                f"trainer, engine logprobs and mask differ in shape: {tuple(trainer.shape)}, "
                f"{tuple(engine.shape)}, {tuple(mask.shape)}"
            )
        device = trainer.device
        keep = mask.to(device) != 0
        diff = (upcast_float(trainer) - upcast_float(engine.to(device))).abs()[keep]
        if not diff.numel():
            return
        self.abs_sum += float(diff.sum())
        self.tokens += diff.numel()
        self.over += float((diff > self.threshold).sum())
        # NaN must survive into the metric (Python's max would drop it): it means a broken
        # logprob on one side, which is what this guard is for.
        largest = float(diff.max())
        nan = math.isnan(largest) or math.isnan(self.largest)
        self.largest = math.nan if nan else max(self.largest, largest)

    def summed(self, total: Callable[[float], float]) -> LogprobGap:
        """The gap over every worker: counts and sums through ``total`` (a sum over workers,
        ``GradSync.total``); the largest stays this worker's (a group takes the max)."""
        return LogprobGap(
            total(self.abs_sum), total(self.tokens), total(self.over), self.largest, self.threshold
        )

    def metrics(self, prefix: str = "policy/") -> dict[str, float]:
        """``logprob_diff_mean``, ``_max`` and ``_frac_over_<threshold>``; 0 without tokens."""
        n = self.tokens
        return {
            f"{prefix}logprob_diff_mean": self.abs_sum / n if n else 0.0,
            f"{prefix}logprob_diff_max": self.largest,
            f"{prefix}logprob_diff_frac_over_{self.threshold:g}": self.over / n if n else 0.0,
        }
