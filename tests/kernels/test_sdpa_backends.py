"""The engine's and the trainer's attention calls never run cuDNN's SDPA kernel
(``clew.kernels.sdpa_backends``), backward passes and recomputed forwards included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clew.data.rows import generate_rows
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.kernels.sdpa_backends import without_cudnn_attention
from clew.rollout.loop import RolloutSettings, play
from clew.train import PolicyWorker, PPOSettings, WorkerSettings
from clew.train.training_batch import TrainingBatch
from clew.trainer.demonstrations import demonstrations

OPTIONS = {"cell_px": 28, "action_format": "keyword", "max_turns": 12}


@pytest.fixture
def attention_calls(monkeypatch) -> list[bool]:
    """Whether cuDNN's kernel was allowed at each SDPA call made while the test runs."""
    seen: list[bool] = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return seen


def test_the_block_allows_every_sdpa_kernel_but_cudnns_and_restores_them_after():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with without_cudnn_attention():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_a_rollouts_forwards_run_without_cudnn_attention(model_dir, chat, attention_calls):
    torch.backends.cuda.enable_cudnn_sdp(True)  # as PyTorch starts
    model = PolicyWorker.from_pretrained(model_dir, WorkerSettings()).model
    rows = generate_rows("maze_2d/tiny", 2, env_options=OPTIONS)
    settings = RolloutSettings(
        n_samples_per_prompt=2, max_turns=3, sampling=SamplingParams(max_tokens=3)
    )
    play(InferenceEngine(model, chat), rows, settings, seed=0)
    assert attention_calls and not any(attention_calls)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # left as it was


@pytest.mark.parametrize("checkpointing", [False, True])
def test_an_updates_forwards_and_backward_run_without_cudnn_attention(
    model_dir, chat, attention_calls, checkpointing
):
    torch.backends.cuda.enable_cudnn_sdp(True)
    worker = PolicyWorker.from_pretrained(
        model_dir, WorkerSettings(gradient_checkpointing=checkpointing)
    )
    rows = generate_rows("maze_2d/tiny", 8, env_options=OPTIONS)
    seqs = demonstrations(rows, chat, seed=3, start_anywhere=1.0)[:2]
    assert seqs
    old = worker.compute_logprobs(seqs)
    advantages = torch.ones(len(seqs))  # one an episode
    forwards = len(attention_calls)
    worker.train_batch(TrainingBatch(seqs, advantages, old), PPOSettings())
    assert len(attention_calls) > forwards
    assert not any(attention_calls)
