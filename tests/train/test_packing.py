"""Packed SFT batches: several sequences a row, the same loss and gradient as one a row."""

from __future__ import annotations

import pytest
import torch

from clew.data.rows import generate_rows
from clew.train import PolicyWorker, WorkerSettings
from clew.train.micro_batches import pack_rows
from clew.train.model_batch import collate
from clew.train.objectives import GradientPass, sft_objective
from clew.trainer.demonstrations import demonstrations

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS = {"cell_px": 28, "action_format": "keyword", "max_turns": 12}


@pytest.fixture(scope="module")
def demos(chat):
    """Solver episodes of mixed lengths, each seeing only its latest frame."""
    rows = generate_rows("maze_2d/tiny", 12, env_options=OPTIONS)
    out = sorted(
        demonstrations(rows, chat, detour_prob=0.4, seed=3, start_anywhere=1.0),
        key=lambda d: len(d.token_ids),
    )
    out = out[:3] + out[-3:]  # short ones fit beside long ones
    assert len(out[0].token_ids) + len(out[1].token_ids) <= len(out[-1].token_ids)
    for d in out:
        d.image_window = 1
    return out


def test_pack_rows_fills_rows_first_fit_decreasing():
    assert pack_rows([5, 3, 2, 4, 1], 6) == [[0, 4], [3, 2], [1]]
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows([7], 6)


def test_a_packed_batch_holds_every_token_once_in_fewer_rows(chat, demos):
    plain = collate(demos, chat)
    packed = collate(demos, chat, pack=True)
    assert len(packed.lengths) < len(plain.lengths)  # rows
    assert packed.num_sequences == plain.num_sequences == len(demos)
    assert sum(packed.lengths) == sum(plain.lengths)
    assert packed.num_target_tokens == plain.num_target_tokens
    assert torch.equal(packed.image_grid_thw.sum(0), plain.image_grid_thw.sum(0))
    # Each token's ids, positions and loss flags are the plain batch's, only moved.
    assert sorted(packed.input_ids[packed.attention_mask > 0].tolist()) == sorted(
        plain.input_ids[plain.attention_mask > 0].tolist()
    )


def test_a_packed_sequence_attends_only_to_itself(chat, demos):
    packed = collate(demos, chat, pack=True)
    allowed = packed.visibility[:, 0]
    doc = packed.document
    real = doc >= 0
    cross = (doc[:, :, None] != doc[:, None, :]) & real[:, :, None] & real[:, None, :]
    assert not allowed[cross].any()
    assert (doc.max(1).values >= 1).any()  # some row holds two sequences


def test_packed_sft_step_gives_the_loss_and_gradient_of_the_unpacked_one(model_dir, demos):
    stats, grads = [], []
    # Packed, a micro-batch is 2 rows: the gradient accumulates over micro-batches too.
    for pack, micro in ((False, len(demos)), (True, 2)):
        worker = PolicyWorker.from_pretrained(
            model_dir, WorkerSettings(lr=1e-3, pack_sequences=pack)
        )
        # The gradient itself, before any step (sft_step clears it after stepping).
        gradient = GradientPass(sft_objective, worker.vision(demos), micro, pack=pack)
        worker.accumulate(demos, range(len(demos)), gradient)
        grads.append(torch.cat([p.grad.flatten() for p in worker.model.parameters()]))
        stats.append(worker.sft_step(demos, micro))
    plain, packed = stats
    assert plain["sft/tokens"] == packed["sft/tokens"]
    assert packed["sft/loss"] == pytest.approx(plain["sft/loss"], rel=1e-5)
    assert packed["sft/grad_norm"] == pytest.approx(plain["sft/grad_norm"], rel=1e-4)
    scale = grads[0].abs().max().item()
    assert torch.allclose(grads[0], grads[1], atol=1e-5 * scale, rtol=1e-4)


def test_a_sequence_that_starts_in_the_loss_cannot_be_packed(chat, demos):
    bad = demos[0]
    bad.loss_mask = [1] + bad.loss_mask[1:]
    try:
        with pytest.raises(ValueError, match="starts inside the loss mask"):
            collate([bad, demos[1]], chat, pack=True)
    finally:
        bad.loss_mask = [0] + bad.loss_mask[1:]
