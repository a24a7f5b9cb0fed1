"""``trainer.flex_attention``: training forwards through FlexAttention under a block mask of
the batch's visibility give the dense mask's logprobs, loss and gradients."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from support.workers import assert_same_gradient, grads, make_worker
from torch.nn.attention.flex_attention import create_mask
from transformers import AttentionInterface

from clew.config import load_config
from clew.errors import ClewError, ConfigError
from clew.models.packed_attention import FLEX, flex_sdpa
from clew.train import PPOSettings
from clew.train.model_batch import collate
from clew.train.objectives import GradientPass, sft_objective
from clew.train.training_batch import TrainingBatch
from clew.trainer.launch import build_worker_group

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_the_block_mask_shows_each_real_query_what_the_dense_mask_does(chat, seqs, pack):
    batch = collate(seqs, chat, pack=pack, row_width=10_000 if pack else None)
    rows, width = batch.input_ids.shape
    block_mask = batch.model_inputs("cpu", flex=True)["attention_mask"]
    got = create_mask(block_mask.mask_mod, rows, 1, width, width, device="cpu")
    want = batch.visibility
    real = torch.arange(width)[None, :] < torch.tensor(batch.lengths)[:, None]
    assert torch.equal(got[:, 0][real], want[:, 0][real])
    # Something is hidden beyond causality: the test compares more than two causal masks.
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    assert not torch.equal(got[:, 0][real], causal.expand(rows, -1, -1)[real])


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_flex_attention_scores_the_dense_masks_logprobs(
    model_dir, seqs, remove_padding, monkeypatch
):
    """The forward alone: on the CPU FlexAttention has no backward."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return flex_sdpa(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, FLEX, counted)
    plain = make_worker(model_dir, lora_rank=4, remove_padding=remove_padding)
    flex = make_worker(model_dir, lora_rank=4, remove_padding=remove_padding, flex_attention=True)
    want = plain.compute_logprobs(seqs, 0.8, micro_batch_size=2)
    assert not calls
    got = flex.compute_logprobs(seqs, 0.8, micro_batch_size=2)
    layers = flex.model.config.text_config.num_hidden_layers
    assert len(calls) >= layers  # every layer of every forward (3 micro-batches padded)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=0)
    assert flex.model.config.text_config._attn_implementation == "sdpa"  # restored


def test_flex_attention_refuses_a_dense_mask():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ClewError, match="block mask"):
        flex_sdpa(torch.nn.Module(), q, q, q, torch.zeros(1, 1, 4, 4))


def test_flex_attention_is_refused_on_the_cpu():
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        load_config(None, ["trainer.flex_attention=true", "trainer.device=cpu"])


def test_a_run_whose_policy_lands_on_the_cpu_is_refused_flex_attention(model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(
        None, [f"trainer.policy.model.path={model_dir}", "trainer.flex_attention=true"]
    )
    with pytest.raises(ConfigError, match="policy is on cpu"):
        build_worker_group(cfg, num_train_rows=4)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """float32 products in full precision within the block. Loading a policy on CUDA allows
    TF32 (``clew.models.loading``), and FlexAttention's kernel then multiplies in TF32 where
    the dense mask's memory-efficient kernel does not: a difference of precision, not of
    masks (a loss 2.8e-4 apart, relatively, on an H100)."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


LAYOUTS = {
    "padded": {},
    "packed": {"remove_padding": True},
    "checkpointed": {"gradient_checkpointing": True},
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_flex_attention_gives_the_dense_masks_ppo_loss_and_gradient(model_dir, seqs, layout):
    settings = PPOSettings(micro_batch_size=2, forward_micro_batch_size=3, temperature=0.9)
    workers = [
        make_worker(model_dir, "cuda", flex_attention=flex, **LAYOUTS[layout])
        for flex in (False, True)
    ]
    gen = torch.Generator().manual_seed(0)
    with ieee_float32():
        old = workers[0].compute_logprobs(seqs)
        advantages = torch.randn(len(seqs), generator=gen)
        batch = TrainingBatch(seqs, advantages, [lp - 0.05 for lp in old])
        want, got = (w.accumulate_gradients(batch, settings) for w in workers)
    assert got is not None and want is not None
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    assert_same_gradient(grads(workers[1]), grads(workers[0]))


@pytest.mark.gpu
@needs_cuda
def test_flex_attention_gives_a_packed_sft_steps_loss_and_gradient(model_dir, seqs):
    demos = [s for s in seqs if s.images]
    stats, gradients = [], []
    for flex in (False, True):
        worker = make_worker(model_dir, "cuda", pack_sequences=True, flex_attention=flex)
        with ieee_float32():
            out = worker.accumulate(
                demos,
                range(len(demos)),
                GradientPass(sft_objective, worker.vision(demos), 2, pack=True),
            )
        stats.append(out)
        gradients.append(grads(worker))
    assert stats[1]["loss"] == pytest.approx(stats[0]["loss"], rel=1e-5)
    assert_same_gradient(gradients[1], gradients[0])
