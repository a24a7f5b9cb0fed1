"""The update path's switches: packed micro-batches without padding, token budgets, chunked
logprobs and gradient checkpointing each give the plain path's logprobs, loss and gradient."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from support.fsdp import ATOL, FULL, Ranks, assert_same_weights
from support.tiny import env_data, tiny_policy
from support.workers import assert_same_gradient, grads, make_worker

from clew.config import load_config
from clew.data.rows import generate_rows
from clew.errors import ClewError
from clew.metrics import read_history
from clew.models.logit_masks import keep_allowed, mask_banned
from clew.models.packed_attention import PackedLayout, packed_attention, packed_sdpa
from clew.models.token_logprobs import token_logprobs
from clew.train import PolicyWorker, PPOSettings, WorkerSettings
from clew.train import forward as forward_module
from clew.train.forward import logits_at
from clew.train.micro_batches import token_micro_batches
from clew.train.model_batch import collate
from clew.train.objectives import GradientPass, sft_objective
from clew.train.training_batch import TrainingBatch
from clew.trainer.demonstrations import demonstrations
from clew.trainer.launch import build_worker_group
from clew.trainer.sft_launch import run_sft_stage

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS = {"cell_px": 28, "action_format": "keyword", "max_turns": 12}

SWITCHES = {
    "remove_padding": {"remove_padding": True},
    "token_budget": {"max_tokens_per_microbatch": 900},
    "packed_token_budget": {"remove_padding": True, "max_tokens_per_microbatch": 900},
    "chunked_logprobs": {"logprobs_chunk_size": 5},
    "gradient_checkpointing": {"gradient_checkpointing": True},
    "all": {
        "remove_padding": True,
        "max_tokens_per_microbatch": 900,
        "logprobs_chunk_size": 7,
        "gradient_checkpointing": True,
    },
}


SFT_SWITCHES = ["trainer.gradient_checkpointing=true", "trainer.logprobs_chunk_size=16"]


def turns(seq) -> int:
    mask = seq.loss_mask
    return sum(1 for a, b in zip([0, *mask], mask, strict=False) if b and not a)


def ppo_batch(worker: PolicyWorker, seqs) -> TrainingBatch:
    """``seqs`` with per-turn advantages and old logprobs a little off the policy's."""
    gen = torch.Generator().manual_seed(0)
    advantages = [torch.randn(turns(s), generator=gen) for s in seqs]
    old = [lp - 0.1 * torch.rand(lp.shape, generator=gen) for lp in worker.compute_logprobs(seqs)]
    return TrainingBatch(seqs, advantages, old)


def test_packed_attention_keeps_each_sequence_to_its_own_causal_past():
    gen = torch.Generator().manual_seed(0)
    # Two rows of 9: [3 + 4 + 2 padding], [5 + 4]; 4 query heads over 2 KV heads.
    document = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1, -1], [0, 0, 0, 0, 0, 1, 1, 1, 1]])
    q = torch.randn(2, 4, 9, 8, generator=gen)
    k, v = torch.randn(2, 2, 9, 8, generator=gen), torch.randn(2, 2, 9, 8, generator=gen)
    layout = PackedLayout.build(document)
    assert [tuple(g.index.shape) for g in layout.groups] == [(1, 3), (2, 4), (1, 5)]
    module = torch.nn.Module()
    out, _ = packed_sdpa(module, q, k, v, None, scaling=0.3, packed_layout=layout)
    assert out.shape == (2, 9, 4, 8) and layout.calls == 1
    for row, start, end in [(0, 0, 3), (0, 3, 7), (1, 0, 5), (1, 5, 9)]:
        alone = F.scaled_dot_product_attention(
            q[row : row + 1, :, start:end],
            k[row : row + 1, :, start:end].repeat_interleave(2, 1),
            v[row : row + 1, :, start:end].repeat_interleave(2, 1),
            is_causal=True,
            scale=0.3,
        )
        torch.testing.assert_close(out[row, start:end], alone[0].transpose(0, 1))
    assert not out[0, 7:].any()  # padding attends to nothing


def test_a_sequence_that_hides_images_attends_as_its_visibility_mask_says():
    gen = torch.Generator().manual_seed(1)
    # One row: a text sequence of 3, then one of 6 with two one-token images at 1 and 3, of
    # which the first is hidden from the tokens after the second.
    document = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    image_of_key = torch.tensor([[-1, -1, -1, -1, 0, -1, 1, -1, -1]])
    hidden_below = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1]])
    layout = PackedLayout.build(document, hidden_below, image_of_key)
    assert [g.mask is not None for g in layout.groups] == [False, True]
    q, k, v = (torch.randn(1, 2, 9, 4, generator=gen) for _ in range(3))
    out, _ = packed_sdpa(torch.nn.Module(), q, k, v, None, packed_layout=layout)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    causal[3:, 1] = False
    want = F.scaled_dot_product_attention(q[..., 3:, :], k[..., 3:, :], v[..., 3:, :], causal)
    torch.testing.assert_close(out[0, 3:], want[0].transpose(0, 1))


def test_without_a_layout_it_is_transformers_sdpa(model_dir, seqs):
    worker = make_worker(model_dir)
    batch = collate(seqs[:3], worker.chat)
    keep = torch.ones(batch.input_ids.shape, dtype=torch.bool)
    plain = logits_at(worker.model, batch, keep, torch.float32)
    with packed_attention(worker.model):
        inside = logits_at(worker.model, batch, keep, torch.float32)
    assert torch.equal(plain, inside)
    assert worker.model.config.text_config._attn_implementation == "sdpa"  # restored


def test_a_packed_forward_outside_packed_attention_is_refused(model_dir, seqs):
    worker = make_worker(model_dir)
    batch = collate(seqs[:3], worker.chat, pack=True, row_width=10_000)
    keep = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    with pytest.raises(ClewError, match="packed_attention"):
        logits_at(worker.model, batch, keep, torch.float32)


def test_a_token_budget_groups_sequences_by_length_within_the_budget():
    lengths = [50, 10, 40, 30, 20, 120]
    items = list("abcdef")
    padded = token_micro_batches(items, lengths, 100, padded=True)
    # Sorted by length; a group's cost is its count times its longest member.
    assert padded == [["b", "e", "d"], ["c", "a"], ["f"]]
    packed = token_micro_batches(items, lengths, 100, padded=False)
    assert sorted(map(sorted, packed)) == [["a", "b", "c"], ["d", "e"], ["f"]]
    assert packed[-1] == ["f"]  # longer than the budget: a micro-batch of its own
    with pytest.raises(ValueError, match="positive"):
        token_micro_batches(items, lengths, 0, padded=True)


@pytest.mark.parametrize("allowed", [False, True], ids=["banned", "allowed"])
def test_chunked_logprobs_are_the_whole_logits_logprobs_with_their_gradients(allowed):
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False)
    hidden = torch.randn(11, 16, generator=gen, requires_grad=True)
    banned = torch.tensor([3, 7])
    keep = torch.tensor([1, 2, 5, 9, 11, 20]) if allowed else None
    targets = keep[torch.arange(11) % 6] if allowed else torch.randint(8, 40, (11,), generator=gen)
    logits = mask_banned(head(hidden).float(), banned)
    if allowed:
        logits = keep_allowed(logits, keep)
    z = logits / 0.7
    want_lp = z.gather(-1, targets[:, None])[:, 0] - z.logsumexp(-1)
    p = z.softmax(-1)
    want_h = z.logsumexp(-1) - (p * torch.where(z.isfinite(), z, 0.0)).sum(-1)
    want_grads = torch.autograd.grad(
        want_lp.sum() + 0.5 * want_h.sum(), [hidden, head.weight], retain_graph=True
    )
    got = token_logprobs(
        hidden, head, targets, banned=banned, allowed=keep, temperature=0.7, chunk_size=4,
        with_entropy=True,
    )  # fmt: skip
    torch.testing.assert_close(got.logprobs, want_lp)
    torch.testing.assert_close(got.entropy, want_h)
    assert torch.equal(got.greedy, logits.argmax(-1))
    got_grads = torch.autograd.grad(
        got.logprobs.sum() + 0.5 * got.entropy.sum(), [hidden, head.weight]
    )
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("switch", list(SWITCHES), ids=list(SWITCHES))
def test_each_switch_scores_the_plain_paths_logprobs(model_dir, seqs, switch):
    plain, switched = (
        make_worker(model_dir, lora_rank=4),
        make_worker(model_dir, lora_rank=4, **SWITCHES[switch]),
    )
    for adapter in (True, False):  # the policy, and the KL reference (the adapter off)
        want = plain.compute_logprobs(seqs, 0.8, micro_batch_size=2, adapter_enabled=adapter)
        got = switched.compute_logprobs(seqs, 0.8, micro_batch_size=2, adapter_enabled=adapter)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=0)


def test_packed_rows_bring_visibility_masks_only_for_sequences_that_hide_images(chat, seqs):
    batch = collate(seqs, chat, pack=True, row_width=10_000)
    assert len(batch.lengths) == 1 and sum(batch.attention_mask[0]) == batch.input_ids.shape[1]
    layout = batch.model_inputs("cpu")["packed_layout"]
    masked = sum(g.index.shape[0] for g in layout.groups if g.mask is not None)
    assert 0 < masked < len(seqs)


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
@pytest.mark.parametrize("switch", list(SWITCHES), ids=list(SWITCHES))
def test_each_switch_gives_the_plain_ppo_loss_and_gradient(model_dir, seqs, switch, reduction):
    """Full fine-tuning (the output projection's gradient passes the logprob chunks), with
    per-turn advantages, the KL term against the initial weights and an entropy bonus."""
    settings = PPOSettings(
        loss_reduction=reduction, micro_batch_size=2, forward_micro_batch_size=3,
        use_kl_loss=True, kl_loss_coef=0.1, entropy_loss_coef=0.01, temperature=0.9,
    )  # fmt: skip
    plain = make_worker(model_dir, kl_reference=True)
    batch = ppo_batch(plain, seqs)
    want = plain.accumulate_gradients(batch, settings)
    switched = make_worker(model_dir, kl_reference=True, **SWITCHES[switch])
    got = switched.accumulate_gradients(batch, settings)
    assert got is not None and want is not None
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    assert_same_gradient(grads(switched), grads(plain))


def test_a_packed_sft_step_with_chunked_logprobs_gives_the_plain_loss_and_gradient(model_dir, seqs):
    demos = [s for s in seqs if s.images]
    stats, gradients = [], []
    for settings in (
        {},
        {"pack_sequences": True, "logprobs_chunk_size": 6, "gradient_checkpointing": True},
    ):
        worker = make_worker(model_dir, **settings)
        pack = settings.get("pack_sequences", False)
        gradient = GradientPass(sft_objective, worker.vision(demos), 2, pack=pack)
        out = worker.accumulate(demos, range(len(demos)), gradient)
        stats.append(out)
        gradients.append(grads(worker))
    assert stats[1]["loss"] == pytest.approx(stats[0]["loss"], rel=1e-5)
    assert stats[1]["token_accuracy"] == pytest.approx(stats[0]["token_accuracy"])
    assert_same_gradient(gradients[1], gradients[0])


def test_the_trainer_keys_reach_the_worker(model_dir):
    overrides = [
        f"trainer.policy.model.path={model_dir}",
        "trainer.device=cpu",
        "trainer.remove_microbatch_padding=true",
        "trainer.max_tokens_per_microbatch=4096",
        "trainer.logprobs_chunk_size=256",
        "trainer.gradient_checkpointing=true",
    ]
    group = build_worker_group(load_config(None, overrides), num_train_rows=4)
    s = group.worker.settings
    assert (s.remove_padding, s.max_tokens_per_microbatch) == (True, 4096)
    assert (s.logprobs_chunk_size, s.gradient_checkpointing) == (256, True)
    assert any(getattr(m, "gradient_checkpointing", False) for m in group.worker.model.modules())
    # CUDA graphs are the default where there is CUDA; a CPU run steps eagerly.
    assert group.engine.cuda_graphs is False
    plain = build_worker_group(load_config(None, overrides[:2]), num_train_rows=4).worker.settings
    assert (plain.remove_padding, plain.max_tokens_per_microbatch) == (False, None)
    assert (plain.logprobs_chunk_size, plain.gradient_checkpointing) == (None, False)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_tokens_per_microbatch=0", "max_tokens_per_microbatch must be >= 1"),
        ("trainer.logprobs_chunk_size=0", "logprobs_chunk_size must be >= 1"),
    ],
)
def test_bad_update_settings_are_refused_by_the_config(override, message):
    with pytest.raises(Exception, match=message):
        load_config(None, [override])


def test_sharded_workers_with_every_switch_take_one_plain_workers_step(model_dir, seqs):
    """Two FSDP ranks, one with three sequences in two token-budget micro-batches and one with
    a single sequence, so the second runs passes with no loss to keep in step."""
    switched = replace(
        FULL,
        remove_padding=True,
        max_tokens_per_microbatch=1300,
        logprobs_chunk_size=8,
        gradient_checkpointing=True,
    )
    imaged = [s for s in seqs if s.images][:4]
    plain = PolicyWorker.from_pretrained(model_dir, FULL)
    start = plain.state_dict()
    batch = ppo_batch(plain, imaged)
    settings = PPOSettings(micro_batch_size=4, use_kl_loss=True, kl_loss_coef=0.5)
    metrics = plain.train_batch(batch, settings)
    ranks = Ranks(2, model_dir, switched, num_threads=1, strategy="fsdp")
    try:
        ranks.call("load_state_dict", start)
        got = ranks.call(
            "update", per_rank=[(batch.select([0, 1, 2]), settings), (batch.select([3]), settings)]
        )
        state = ranks.call("state_dict")[0]
    finally:
        ranks.close()
    assert_same_weights(state["trainable"], plain.state_dict()["trainable"], atol=ATOL)
    for m in got:
        assert m["policy/grad_norm"] == pytest.approx(metrics["policy/grad_norm"], rel=1e-5)
        assert m["policy/kl_loss"] == pytest.approx(metrics["policy/kl_loss"], abs=1e-6)


def test_sft_reads_the_trainer_keys_and_logs_the_plain_runs_losses(
    model_dir, tmp_path, monkeypatch
):
    rows_path = env_data("maze_2d/tiny", 4, env_options=OPTIONS)
    built: list[WorkerSettings] = []
    init = PolicyWorker.__init__

    def recording(self, model, chat, settings=None):
        built.append(settings)
        init(self, model, chat, settings)

    monkeypatch.setattr(PolicyWorker, "__init__", recording)
    losses = []
    for name, extra in (("plain", []), ("switched", SFT_SWITCHES)):
        cfg = load_config(
            None,
            [
                f"sft.model_path={model_dir}",
                f"data.train_data=['{rows_path}']",
                f"trainer.log_path={tmp_path / name}",
                "trainer.logger=jsonl",
                "sft.steps=2",
                "sft.batch_size=2",
                *extra,
            ],
        )
        result = run_sft_stage(cfg)
        losses.append([r["sft/loss"] for r in read_history(result.run_dir)])
    assert len(losses[0]) == 2
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert [(s.gradient_checkpointing, s.logprobs_chunk_size) for s in built] == [
        (False, None),
        (True, 16),
    ]


def test_chunked_logprobs_need_no_boolean_logits_to_keep(model_dir, seqs, monkeypatch):
    # Older transformers (the GPU image's) take logits_to_keep as shared positions only.
    want = make_worker(model_dir).compute_logprobs(seqs)
    monkeypatch.setattr(forward_module, "BOOLEAN_LOGITS_TO_KEEP", False)
    got = make_worker(model_dir, logprobs_chunk_size=5).compute_logprobs(seqs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=0)


def test_every_switch_at_once_on_qwen3_vl_gives_the_plain_gradient():
    path = tiny_policy(arch="qwen3_vl", image_size=128)
    rows = generate_rows("maze_2d/tiny", 6, env_options={**OPTIONS, "cell_px": 32})
    plain = make_worker(path, kl_reference=True)
    demos = demonstrations(rows, plain.chat, seed=3, start_anywhere=1.0)[:4]
    for d in demos[::2]:
        d.image_window = 1
    batch = ppo_batch(plain, demos)
    settings = PPOSettings(micro_batch_size=2, use_kl_loss=True, kl_loss_coef=0.1)
    want = plain.accumulate_gradients(batch, settings)
    switched = make_worker(path, kl_reference=True, **SWITCHES["all"])
    got = switched.accumulate_gradients(batch, settings)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert_same_gradient(grads(switched), grads(plain))
