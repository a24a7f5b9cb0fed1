"""Tests for clew.train: batch building and the PolicyWorker's logprobs, updates and state."""

from __future__ import annotations

import math

import pytest
import torch

from clew.cluster.group import LocalWorkerGroup
from clew.data.rows import generate_rows
from clew.errors import ClewError
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import load_policy
from clew.models.chat import ChatFormat
from clew.rollout.loop import RolloutSettings, play
from clew.rollout.trajectory import Trajectory
from clew.train import PolicyWorker, PPOSettings, WorkerSettings
from clew.train import forward as forward_module
from clew.train.lora import merged_for_rollouts
from clew.train.micro_batches import micro_batches
from clew.train.model_batch import Sample, collate, target_values
from clew.train.training_batch import TrainingBatch, share_sizes

OPTIONS = {"cell_px": 28, "action_format": "keyword"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rows():
    return generate_rows("maze_2d/tiny", 2, env_options=OPTIONS)


def make_worker(model_dir, **settings) -> PolicyWorker:
    return PolicyWorker.from_pretrained(model_dir, WorkerSettings(**settings))


def rollout(worker: PolicyWorker, rows, temperature: float = 1.0) -> list[Trajectory]:
    engine = InferenceEngine(worker.model, worker.chat)
    sampling = SamplingParams(temperature=temperature, max_tokens=6)
    settings = RolloutSettings(n_samples_per_prompt=2, max_turns=3, sampling=sampling)
    return play(engine, rows, settings, seed=0)


@pytest.fixture(scope="module")
def trajectories(model_dir, rows) -> list[Trajectory]:
    """Episodes sampled by the untrained model (every fresh worker starts from it)."""
    return rollout(make_worker(model_dir), rows)


def masked(lp: torch.Tensor, seq) -> torch.Tensor:
    return lp[torch.tensor(seq.loss_mask[1:], dtype=torch.bool)]


def sum_logprob(worker: PolicyWorker, seq, **kwargs) -> float:
    return float(masked(worker.compute_logprobs([seq], **kwargs)[0], seq).sum())


def batch_of(seqs, advantages: list[float]) -> TrainingBatch:
    """``seqs`` with the logprobs they were sampled with and one advantage each."""
    return TrainingBatch.from_trajectories(seqs, torch.tensor(advantages))


def max_diff(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(xs, ys, strict=True))


def test_collate_right_pads_and_shifts_targets_by_one(model_dir):
    chat = ChatFormat(load_policy(model_dir)[1])
    a = Sample([5, 6, 7, 8], [0, 0, 1, 1])
    b = Sample([9, 10], [0, 1])
    batch = collate([a, b], chat, values={"adv": [torch.tensor([0, 0, 2.0, 3.0]), [4.0]]})
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, chat.pad_id, chat.pad_id]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.targets[0].tolist() == [6, 7, 8]
    assert batch.target_mask.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch.values["adv"].tolist() == [[0, 2, 3], [4, 0, 0]]
    assert batch.position_ids.shape == (3, 2, 4)
    assert batch.position_ids[:, 0].tolist() == [[0, 1, 2, 3]] * 3
    assert micro_batches(list(range(5)), 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="one per token"):
        target_values([1.0, 2.0], 5)


def test_a_training_batch_spreads_sequence_and_turn_advantages_onto_reply_tokens():
    a = Sample([1, 2, 3, 4, 5, 6], [0, 1, 1, 0, 1, 0])  # two turns: tokens 1-2 and 4
    b = Sample([1, 2, 3], [0, 1, 1])
    old = [torch.zeros(6), torch.zeros(3)]
    per_sequence = TrainingBatch([a, b], torch.tensor([2.0, -1.0]), old).token_advantages()
    assert [t.tolist() for t in per_sequence] == [[0, 2, 2, 0, 2, 0], [0, -1, -1]]
    turns = [torch.tensor([0.5, -3.0]), torch.tensor([4.0])]
    per_turn = TrainingBatch([a, b], turns, old).token_advantages()
    assert [t.tolist() for t in per_turn] == [[0, 0.5, 0.5, 0, -3, 0], [0, 4, 4]]
    with pytest.raises(ValueError, match="2 sequences has 1 old_logprobs"):
        TrainingBatch([a, b], torch.tensor([2.0, -1.0]), old[:1])
    with pytest.raises(ValueError, match="2 replies for 1 turn advantages"):
        TrainingBatch([a], [torch.tensor([1.0])], old[:1]).token_advantages()


def test_a_split_gives_each_worker_its_share_of_every_mini_batch():
    seqs = [Sample([1, i], [0, 1]) for i in range(8)]
    batch = TrainingBatch(seqs, torch.arange(8.0), [torch.zeros(2)] * 8)
    shares = batch.split(2, mini_batch_size=4)
    assert [s.advantages.tolist() for s in shares] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [[q.token_ids[1] for q in s.sequences] for s in shares] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    (whole,) = batch.split(1)
    assert whole.advantages.tolist() == batch.advantages.tolist()
    turns = TrainingBatch(
        seqs[:2], [torch.tensor([1.0]), torch.tensor([2.0])], [torch.zeros(2)] * 2
    )
    assert [s.advantages[0].item() for s in turns.split(2)] == [1.0, 2.0]
    # Three workers: each mini-batch of 4 goes 2/1/1, and a batch smaller than the group
    # leaves a worker an empty share (it still joins every collective).
    uneven = batch.split(3, mini_batch_size=4)
    assert [s.advantages.tolist() for s in uneven] == [[0, 1, 4, 5], [2, 6], [3, 7]]
    assert share_sizes(8, 4, 3) == [[2, 2], [1, 1], [1, 1]]
    assert [len(s) for s in turns.split(3)] == [1, 1, 0] and share_sizes(2, None, 3)[2] == [0]


def test_collate_rejects_placeholders_without_images(model_dir):
    chat = ChatFormat(load_policy(model_dir)[1])
    with pytest.raises(ValueError, match="image placeholder"):
        collate([Sample([1, chat.image_token_id, 2], [0, 0, 1])], chat)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_worker_logprobs_match_engine_sampling_logprobs(model_dir, rows, temperature):
    worker = make_worker(model_dir)
    trajs = rollout(worker, rows, temperature)
    computed = worker.compute_logprobs(trajs, temperature=temperature, micro_batch_size=3)
    diffs = [
        (masked(lp, t) - masked(torch.tensor(t.logprobs[1:]), t)).abs().max().item()
        for t, lp in zip(trajs, computed, strict=True)
    ]
    assert sum(t.generated_tokens for t in trajs) > 0
    assert max(diffs) < 1e-4, f"max |worker - engine| logprob difference: {max(diffs):.3g}"


ACTIONS = ("up", "down", "left", "right", "stop")


def test_allowed_tokens_are_all_that_is_sampled_and_the_worker_scores_them_as_sampled(
    model_dir, rows
):
    worker = make_worker(model_dir, lr=1e-2)
    engine = InferenceEngine(worker.model, worker.chat)
    allowed = set(engine.allowed_ids(ACTIONS).tolist())
    settings = RolloutSettings(
        n_samples_per_prompt=4,
        max_turns=3,
        reply_prefix="<action>",
        reply_suffix="</action>",
        sampling=SamplingParams(temperature=1.5, max_tokens=1, allowed_tokens=ACTIONS),
    )
    trajs = play(engine, rows, settings, seed=0)
    sampled = [tok for t in trajs for tok, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
    assert sampled and set(sampled) <= allowed
    assert sum(t.parse_errors for t in trajs) == 0
    computed = worker.compute_logprobs(trajs, temperature=1.5, allowed=ACTIONS)
    engine_lp = [masked(torch.tensor(t.logprobs[1:]), t) for t in trajs]
    assert (
        max_diff([masked(lp, t) for t, lp in zip(trajs, computed, strict=True)], engine_lp) < 1e-4
    )
    # over the whole vocabulary the same tokens score lower: the rest holds some mass
    full = worker.compute_logprobs(trajs, temperature=1.5)
    assert all((masked(f, t) < e).all() for t, f, e in zip(trajs, full, engine_lp, strict=True))
    # a step against the sampled tokens lowers their logprobs within the allowed set
    seqs = trajs[:2]
    stats = worker.train_batch(
        batch_of(seqs, [-1.0, -1.0]),
        # with an entropy bonus, which now ranges over the five words only
        PPOSettings(
            temperature=1.5, allowed_tokens=ACTIONS, entropy_loss_coef=0.01, micro_batch_size=2
        ),
    )
    assert 0 < stats["policy/entropy"] <= math.log(len(ACTIONS)) + 1e-6
    after = worker.compute_logprobs(seqs, temperature=1.5, allowed=ACTIONS)
    before = sum(float(masked(lp, t).sum()) for t, lp in zip(seqs, computed[:2], strict=True))
    assert sum(float(masked(a, t).sum()) for t, a in zip(seqs, after, strict=True)) < before - 0.1


def test_an_allowed_token_that_is_several_tokens_is_a_clear_error(model_dir):
    worker = make_worker(model_dir)
    engine = InferenceEngine(worker.model, worker.chat)
    with pytest.raises(ClewError, match="'go north' is .* tokens"):
        engine.allowed_ids(("up", "go north"))


def test_logprobs_are_the_same_without_boolean_logits_to_keep(model_dir, trajectories, monkeypatch):
    worker = make_worker(model_dir)
    boolean = worker.compute_logprobs(trajectories, micro_batch_size=4)
    monkeypatch.setattr(forward_module, "BOOLEAN_LOGITS_TO_KEEP", False)
    union = worker.compute_logprobs(trajectories, micro_batch_size=4)
    assert max_diff(boolean, union) < 1e-5


def test_lora_trains_only_adapters_on_language_model_projections(model_dir):
    worker = make_worker(model_dir, lora_rank=4)
    trainable = [n for n, p in worker.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    wrapped = [n for n, m in worker.model.named_modules() if hasattr(m, "lora_A")]
    assert all(".language_model.layers." in n for n in wrapped)
    kinds = {n.rsplit(".", 1)[-1] for n in wrapped}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    full = make_worker(model_dir)
    assert 0 < worker.trainable_parameters() < full.trainable_parameters() // 10


def test_lora_on_vision_and_language_also_adapts_the_vision_tower(model_dir):
    worker = make_worker(model_dir, lora_rank=4, lora_target_modules="vision_and_language")
    wrapped = [n for n, m in worker.model.named_modules() if hasattr(m, "lora_A")]
    assert any(".visual.blocks." in n for n in wrapped)
    assert any(".language_model.layers." in n for n in wrapped)
    assert not any(n.endswith("lm_head") for n in wrapped)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_ppo_update_moves_logprob_in_the_direction_of_the_advantage(
    model_dir, trajectories, sign
):
    worker = make_worker(model_dir, lr=1e-3)
    seq = trajectories[0]
    before = sum_logprob(worker, seq)
    stats = worker.train_batch(batch_of([seq], [sign]), PPOSettings())
    after = sum_logprob(worker, seq)
    assert sign * (after - before) > 0.1, (before, after)
    assert stats["policy/optimizer_steps"] == 1
    assert stats["policy/clip_fraction"] == 0  # the first step starts at ratio 1
    assert stats["policy/lr"] == pytest.approx(1e-3)
    assert stats["policy/entropy"] > 0 and stats["policy/grad_norm"] > 0


def test_entropy_bonus_alone_gives_a_finite_update(model_dir, trajectories):
    # The worker's logits carry banned ids at -inf; the bonus differentiates through them
    # (it once wrote NaN into every weight on the GPU).
    seqs = trajectories[:2]
    worker = make_worker(model_dir, lr=1e-3)
    before = [p.detach().clone() for p in worker.model.parameters()]
    # Zero advantages: the bonus is the whole gradient.
    settings = PPOSettings(entropy_loss_coef=1.0, micro_batch_size=2)
    stats = worker.train_batch(batch_of(seqs, [0.0, 0.0]), settings)
    assert stats["policy/skipped_steps"] == 0
    assert 0 < stats["policy/grad_norm"] < float("inf")
    after = list(worker.model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a.detach(), b) for a, b in zip(after, before, strict=True))


def test_a_non_finite_gradient_is_dropped_leaving_weights_and_schedule_alone(
    model_dir, trajectories, monkeypatch
):
    worker = make_worker(model_dir, lr=1e-3, num_warmup_steps=4)
    seq = trajectories[0]
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    lr = worker.optimizer.param_groups[0]["lr"]
    real_backward = torch.Tensor.backward

    def nan_backward(self, *a, **k):
        real_backward(self * float("nan"), *a, **k)

    monkeypatch.setattr(torch.Tensor, "backward", nan_backward)
    stats = worker.train_batch(batch_of([seq], [1.0]), PPOSettings())
    monkeypatch.undo()
    assert stats["policy/skipped_steps"] == 1 and stats["policy/optimizer_steps"] == 1
    for n, p in worker.model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
        assert p.grad is None
    assert worker.optimizer.param_groups[0]["lr"] == lr  # the warmup did not advance


def test_lora_reference_is_the_base_model_with_the_adapter_off(
    model_dir, trajectories, monkeypatch
):
    base = make_worker(model_dir).compute_logprobs(trajectories)
    worker = make_worker(model_dir, lora_rank=4, lr=1e-2)
    scored: list[bool] = []  # adapter_enabled of each scoring pass the update makes
    score = worker.compute_logprobs
    monkeypatch.setattr(
        worker,
        "compute_logprobs",
        lambda *a, **k: scored.append(k["adapter_enabled"]) or score(*a, **k),
    )
    settings = PPOSettings(use_kl_loss=True, kl_loss_coef=0.1, mini_batch_size=2, epochs=2)
    stats = worker.train_batch(batch_of(trajectories, [1.0, -1.0, 0.5, -0.5]), settings)
    assert stats["policy/optimizer_steps"] == 4 and stats["policy/kl_loss"] > 0
    assert scored == [False]  # the reference is scored once for all four steps
    monkeypatch.undo()
    on = worker.compute_logprobs(trajectories)
    off = worker.compute_logprobs(trajectories, adapter_enabled=False)
    assert max_diff(on, base) > 1e-3
    assert max_diff(off, base) < 1e-5


def train_adapter(worker: PolicyWorker) -> None:
    """Give the adapter weights a trained one might have: B starts at zero, which would hide
    a delta lost on the way to the samples."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in worker.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.05)


def test_lora_rollouts_sample_the_merged_adapter_and_leave_the_weights_as_they_were(
    model_dir, rows
):
    worker = make_worker(model_dir, lora_rank=4)
    train_adapter(worker)
    weights = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    unmerged = rollout(worker, rows)
    group = LocalWorkerGroup(worker, InferenceEngine(worker.model, worker.chat))
    settings = RolloutSettings(
        n_samples_per_prompt=2, max_turns=3, sampling=SamplingParams(temperature=1.0, max_tokens=6)
    )
    layer = next(m for m in worker.model.modules() if hasattr(m, "lora_A"))
    seen: list[bool] = []
    hook = layer.register_forward_pre_hook(lambda m, args: seen.append(m.merged))
    merged = group.generate(rows, settings, seed=0)
    hook.remove()
    assert seen and all(seen)  # sampled with the adapter merged into the base layer
    assert [t.token_ids for t in merged] == [t.token_ids for t in unmerged]
    assert (
        max_diff(
            [torch.tensor(t.logprobs) for t in merged], [torch.tensor(t.logprobs) for t in unmerged]
        )
        < 1e-4
    )
    after = dict(worker.model.named_parameters())
    assert max((after[n].detach() - w).abs().max().item() for n, w in weights.items()) < 1e-6
    assert not any(getattr(m, "merged", False) for m in worker.model.modules())
    # the delta reached the samples: without the adapter the same tokens score otherwise
    on = worker.compute_logprobs(merged)
    off = worker.compute_logprobs(merged, adapter_enabled=False)
    assert max_diff(on, off) > 1e-2


def test_a_bfloat16_base_comes_back_bit_for_bit_after_a_merged_rollout(model_dir):
    worker = PolicyWorker.from_pretrained(model_dir, WorkerSettings(lora_rank=4), dtype="bfloat16")
    train_adapter(worker)
    layer = next(m for m in worker.model.modules() if hasattr(m, "lora_A"))
    before = layer.get_base_layer().weight.detach().clone()
    for _ in range(3):  # a round trip by subtraction would drift a little each time
        with merged_for_rollouts(worker.model):
            assert layer.merged and not torch.equal(layer.get_base_layer().weight, before)
    assert not layer.merged and torch.equal(layer.get_base_layer().weight, before)
    plain = make_worker(model_dir).model
    with merged_for_rollouts(plain) as same:  # no adapter: nothing to merge
        assert same is plain


def test_full_finetuning_reference_is_a_frozen_copy_of_the_initial_weights(model_dir, trajectories):
    base = make_worker(model_dir).compute_logprobs(trajectories)
    worker = make_worker(model_dir, lr=1e-3, kl_reference=True)
    seqs = trajectories[:2]
    worker.train_batch(batch_of(seqs, [1.0, -1.0]), PPOSettings(micro_batch_size=2))
    off = worker.compute_logprobs(trajectories, adapter_enabled=False)
    assert max_diff(off, base) < 1e-5
    late = make_worker(model_dir, lr=1e-3)
    late.sft_step(seqs, 2)
    with pytest.raises(ClewError, match="initial policy"):
        late.compute_logprobs(seqs, adapter_enabled=False)


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(model_dir, trajectories, reduction):
    worker = make_worker(model_dir)
    old = [lp - 0.05 * i for i, lp in enumerate(worker.compute_logprobs(trajectories))]
    batch = TrainingBatch(trajectories, torch.tensor([1.0, -0.5, 2.0, -1.5]), old)
    grads = []
    for micro in (len(trajectories), 1):
        settings = PPOSettings(loss_reduction=reduction, micro_batch_size=micro)
        stats = worker.accumulate_gradients(batch, settings)
        grads.append(torch.cat([p.grad.flatten() for p in worker.model.parameters()]))
        assert stats is not None and stats["loss"] != 0
        # The micro-batches' device stats come back as Python floats, read at the end.
        assert all(type(v) is float for v in stats.values()), stats
    scale = grads[0].abs().max().item()
    assert torch.allclose(grads[0], grads[1], atol=1e-5 * scale, rtol=1e-4)


def test_state_dict_round_trip_restores_logprobs_and_optimizer(model_dir, trajectories):
    settings = dict(
        lora_rank=4, lr=1e-2, scheduler="cosine", num_warmup_steps=1, num_training_steps=10
    )
    batch = batch_of(trajectories[:2], [1.0, -1.0])

    def update(w: PolicyWorker) -> dict[str, float]:
        return w.train_batch(batch, PPOSettings(mini_batch_size=1))

    a = make_worker(model_dir, **settings)
    update(a)
    state = a.state_dict()
    assert all("lora_" in n for n in state["trainable"])
    b = make_worker(model_dir, **settings)
    b.load_state_dict(state)
    assert max_diff(a.compute_logprobs(trajectories), b.compute_logprobs(trajectories)) == 0
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"])
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])
    assert b.optimizer_steps == 2 and b.scheduler.get_last_lr() == a.scheduler.get_last_lr()
    assert update(a)["policy/lr"] == update(b)["policy/lr"]
    assert max_diff(a.compute_logprobs(trajectories), b.compute_logprobs(trajectories)) < 1e-6


def test_a_state_of_other_lora_settings_is_refused_before_any_weight_changes(model_dir):
    full = make_worker(model_dir)
    before = {n: p.detach().clone() for n, p in full.model.named_parameters()}
    with pytest.raises(ClewError, match="does not fit this model.*missing"):
        full.load_state_dict(make_worker(model_dir, lora_rank=4).state_dict())
    assert all(torch.equal(p, before[n]) for n, p in full.model.named_parameters())


def test_mixed_precision_keeps_float32_weights_and_moves_them_by_small_steps(model_dir, rows):
    # bfloat16 compute (autocast on the CPU here, on CUDA in GPU runs) over float32 weights:
    # the engine samples under the same context, so the trainer's recompute matches it to
    # bfloat16 rounding; an update far below bfloat16's resolution still moves the weights.
    worker = make_worker(model_dir, lr=1e-5, autocast_bf16=True)
    engine = InferenceEngine(worker.model, worker.chat, autocast=True)
    sampling = SamplingParams(temperature=1.0, max_tokens=6)
    trajs = play(engine, rows, RolloutSettings(2, 3, sampling=sampling), seed=0)
    computed = worker.compute_logprobs(trajs, micro_batch_size=3)
    diffs = [
        (masked(lp, t) - masked(torch.tensor(t.logprobs[1:]), t)).abs().max().item()
        for t, lp in zip(trajs, computed, strict=True)
    ]
    assert max(diffs) < 0.1, f"max |worker - engine| logprob difference: {max(diffs):.3g}"
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    assert all(p.dtype == torch.float32 for p in before.values())
    worker.train_batch(
        batch_of(trajs, [1.0, -1.0] * (len(trajs) // 2)), PPOSettings(micro_batch_size=2)
    )
    norm = before["model.language_model.norm.weight"]
    moved = (worker.model.get_parameter("model.language_model.norm.weight") - norm).abs()
    # lr 1e-5 on weights of 1.0: under bfloat16's spacing there (2**-7), so a bfloat16
    # weight would not have changed at all.
    assert 0 < moved.max().item() < 1e-3
    assert (
        norm.to(torch.bfloat16)
        .float()
        .add(moved.max())
        .to(torch.bfloat16)
        .float()
        .equal(norm.to(torch.bfloat16).float())
    )
