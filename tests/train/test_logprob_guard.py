"""The engine-against-trainer logprob guard, recomputed old logprobs and TIS."""

from __future__ import annotations

import copy
import json
import math
import threading

import pytest
import torch
from support.tiny import digits_data, digits_policy

from clew.algorithms import LogprobGap, ppo_clip_loss, tis_weights
from clew.config import load_config
from clew.data.rows import generate_rows
from clew.errors import ConfigError
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.metrics.catalog import describe
from clew.rollout.loop import RolloutSettings, play
from clew.train.settings import PPOSettings, WorkerSettings
from clew.train.training_batch import TrainingBatch
from clew.train.worker import PolicyWorker
from clew.trainer.launch import run_grpo

pytestmark = pytest.mark.usefixtures("one_thread")

GUARD = ("policy/logprob_diff_mean", "policy/logprob_diff_max", "policy/logprob_diff_frac_over_0.1")


# -- TIS and the gap on hand-made tensors ---------------------------------------------------


def test_tis_weights_are_the_capped_trainer_over_engine_ratio() -> None:
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    engine = torch.tensor([[0.0, -1.5, -0.5, 30.0]])
    weights = tis_weights(old, engine, cap=2.0)
    expected = torch.tensor([[1.0, math.exp(0.5), math.exp(-1.5), math.exp(-20.0)]])
    torch.testing.assert_close(weights, expected)
    assert tis_weights(torch.tensor([3.0]), torch.tensor([0.0]), cap=2.0).item() == 2.0
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_weights(old, engine, cap=-1.0)


def test_tis_multiplies_each_tokens_loss_and_gradient_by_its_weight() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -0.3]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.0, -0.2]])
    engine = torch.tensor([[-1.0, -3.0, -0.2]])  # weights e^-0.1, capped e^1 -> 1.5, 1
    adv = torch.tensor([[1.0, -0.5, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    weights = torch.tensor([[math.exp(-0.1), 1.5, 1.0]])

    plain, _ = ppo_clip_loss(logprobs, old, adv, mask, reduction="sequence_mean")
    (grad_plain,) = torch.autograd.grad(plain, logprobs)
    loss, stats = ppo_clip_loss(
        logprobs, old, adv, mask, reduction="sequence_mean",
        rollout_logprobs=engine, tis_imp_ratio_cap=1.5,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logprobs)
    ratio = (logprobs - old).exp().detach()
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    torch.testing.assert_close(loss, (per_token * weights).mean())
    torch.testing.assert_close(grad, grad_plain * weights)
    assert float(stats["tis_weight_mean"]) == pytest.approx(weights.mean().item())
    assert float(stats["tis_capped_fraction"]) == pytest.approx(1 / 3)


def test_tis_with_agreeing_logprobs_leaves_the_loss_as_it_was() -> None:
    logprobs = torch.randn(2, 5)
    old, adv = logprobs + 0.1 * torch.randn(2, 5), torch.randn(2, 5)
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    plain, _ = ppo_clip_loss(logprobs, old, adv, mask)
    same, stats = ppo_clip_loss(logprobs, old, adv, mask, rollout_logprobs=old, tis_imp_ratio_cap=2)
    torch.testing.assert_close(same, plain)
    assert float(stats["tis_weight_mean"]) == 1.0 and float(stats["tis_capped_fraction"]) == 0.0
    with pytest.raises(ValueError, match="tis_imp_ratio_cap"):
        ppo_clip_loss(logprobs, old, adv, mask, rollout_logprobs=old)


def test_the_gap_counts_masked_tokens_only_and_sums_over_workers() -> None:
    gap = LogprobGap()
    gap.add(
        torch.tensor([[-1.0, -2.0, -9.0]]),
        torch.tensor([[-1.05, -2.5, 0.0]]),
        torch.tensor([[1, 1, 0]]),
    )
    assert gap.metrics() == pytest.approx({GUARD[0]: 0.275, GUARD[1]: 0.5, GUARD[2]: 0.5})
    other = LogprobGap()
    other.add(torch.zeros(2), torch.tensor([0.0, 0.3]), torch.ones(2))
    # Two workers' counts summed (as GradSync.total does); each keeps its own largest.
    totals = iter([gap.abs_sum + other.abs_sum, 4.0, 2.0])
    summed = gap.summed(lambda x: next(totals)).metrics()
    assert summed[GUARD[0]] == pytest.approx(0.85 / 4) and summed[GUARD[2]] == 0.5
    assert LogprobGap().metrics() == {GUARD[0]: 0.0, GUARD[1]: 0.0, GUARD[2]: 0.0}
    broken = LogprobGap()
    broken.add(torch.tensor([0.0, math.nan]), torch.zeros(2), torch.ones(2))
    assert math.isnan(broken.metrics()[GUARD[1]])


def test_every_guard_and_tis_metric_is_in_the_catalog() -> None:
    for name in [*LogprobGap().metrics(), "policy/tis_weight_mean", "policy/tis_capped_fraction"]:
        assert describe(name) is not None, name


# -- the worker, on the tiny policy ---------------------------------------------------------

ROLLOUT = RolloutSettings(
    n_samples_per_prompt=2,
    max_turns=2,
    sampling=SamplingParams(temperature=1.0, max_tokens=4),
)


@pytest.fixture(scope="module")
def rows():
    return generate_rows("maze_2d/tiny", 2, env_options={"cell_px": 28, "action_format": "keyword"})


def _rollouts(model_dir, rows, *, autocast=False, perturb=0.0):
    """A float32 worker and a batch its engine sampled: from the worker's own modules, under
    bfloat16 autocast, or from a copy of its weights with noise added."""
    worker = PolicyWorker.from_pretrained(model_dir, WorkerSettings(lr=1e-3))
    sampler = worker.model
    if perturb:
        sampler = copy.deepcopy(worker.model)
        with torch.no_grad():
            for p in sampler.parameters():
                p.add_(perturb * torch.randn_like(p))
    trajs = play(InferenceEngine(sampler, worker.chat, autocast=autocast), rows, ROLLOUT, seed=1)
    advantages = torch.tensor([1.0, -1.0] * (len(trajs) // 2))
    return worker, TrainingBatch.from_trajectories(trajs, advantages)


def test_the_guard_is_zero_when_engine_and_trainer_compute_alike(model_dir, rows) -> None:
    for recompute in (False, True):
        worker, batch = _rollouts(model_dir, rows)
        assert sum(sum(t.loss_mask) for t in batch.sequences) > 0
        stats = worker.train_batch(batch, PPOSettings(recompute_old_logprobs=recompute))
        assert stats[GUARD[0]] < 1e-5 and stats[GUARD[1]] < 1e-4, (recompute, stats)
        assert stats[GUARD[2]] == 0.0


@pytest.mark.parametrize("mismatch", [{"autocast": True}, {"perturb": 0.02}])
def test_the_guard_sees_an_engine_that_computes_otherwise(model_dir, rows, mismatch) -> None:
    """bfloat16 sampling against a float32 trainer, or sampling from other weights; the
    update's first forward (one mini-batch: every token) and the scoring pass agree."""
    free_worker, batch = _rollouts(model_dir, rows, **mismatch)
    free = free_worker.train_batch(batch, PPOSettings())
    scored_worker, _ = _rollouts(model_dir, rows, **mismatch)
    scored = scored_worker.train_batch(batch, PPOSettings(recompute_old_logprobs=True))
    assert free[GUARD[0]] > 1e-3 and free[GUARD[1]] > free[GUARD[0]]
    for name in GUARD:
        assert scored[name] == pytest.approx(free[name], rel=1e-3, abs=1e-6), name


def test_recomputed_old_logprobs_make_the_first_ratio_exactly_one(model_dir, rows) -> None:
    """Against a perturbed engine the first step's PPO ratio is off by the gap; scored by the
    trainer first it is 1, and TIS weighs the loss by the engine/trainer ratio instead."""
    settings = PPOSettings(epochs=1)
    worker, batch = _rollouts(model_dir, rows, perturb=0.02)
    off = worker.accumulate_gradients(batch, settings)
    worker, _ = _rollouts(model_dir, rows, perturb=0.02)
    exact = worker.accumulate_gradients(batch, PPOSettings(recompute_old_logprobs=True))
    assert off["approx_kl"] > 1e-4 and exact["approx_kl"] < 1e-9
    worker, _ = _rollouts(model_dir, rows, perturb=0.02)
    stats = worker.train_batch(batch, PPOSettings(use_tis=True, tis_imp_ratio_cap=2.0))
    assert stats["policy/approx_kl"] < 1e-9
    assert stats["policy/tis_weight_mean"] != pytest.approx(1.0, abs=1e-4)
    assert 0 <= stats["policy/tis_capped_fraction"] <= 1


class _Sum:
    """An all-reduce sum between threads, one ``member`` per worker (``GradSync.total``)."""

    def __init__(self, n: int) -> None:
        self.barrier, self.slots = threading.Barrier(n, timeout=60), [0.0] * n

    def member(self, rank: int):
        def total(x: float) -> float:
            self.slots[rank] = float(x)
            self.barrier.wait()
            out = sum(self.slots)
            self.barrier.wait()
            return out

        class Member:
            pass

        member = Member()
        member.total = total
        member.reduce_ = lambda params: None  # the gradients are not what this test is about
        return member


def test_data_parallel_workers_report_the_whole_batchs_guard(model_dir, rows) -> None:
    worker, batch = _rollouts(model_dir, rows, autocast=True)
    whole = worker.train_batch(batch, PPOSettings(recompute_old_logprobs=True))
    sync = _Sum(2)
    shares = batch.split(2)
    results: list = [None, None]

    def run(rank: int) -> None:
        w, _ = _rollouts(model_dir, rows)
        w.sync = sync.member(rank)
        results[rank] = w.train_batch(shares[rank], PPOSettings(recompute_old_logprobs=True))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None for r in results), "a worker failed or hung"
    for r in results:  # counts summed over the workers: the whole batch's mean and share
        assert r[GUARD[0]] == pytest.approx(whole[GUARD[0]], rel=1e-4)
        assert r[GUARD[2]] == pytest.approx(whole[GUARD[2]], rel=1e-4)
    assert max(r[GUARD[1]] for r in results) == pytest.approx(whole[GUARD[1]], rel=1e-4)


# -- GRPO with each switch ------------------------------------------------------------------


def _grpo(tmp_path, *overrides: str) -> list[dict]:
    cfg = load_config(
        None,
        [
            f"data.train_data=['{digits_data(8)}']",
            f"trainer.policy.model.path={digits_policy()}",
            f"trainer.log_path={tmp_path / 'runs'}",
            "trainer.run_name=guard",
            "trainer.logger=jsonl",
            "trainer.eval_before_train=false",
            "trainer.ckpt_interval=-1",
            "trainer.max_prompt_length=128",
            "trainer.train_batch_size=2",
            "trainer.policy_mini_batch_size=1",
            "trainer.max_steps=2",
            "trainer.policy.optimizer_config.lr=1.0e-3",
            "generator.n_samples_per_prompt=4",
            "generator.max_turns=1",
            "generator.sampling_params.max_generate_length=4",
            "generator.max_input_length=512",
            *overrides,
        ],
    )
    run_grpo(cfg)
    lines = (tmp_path / "runs" / "guard" / "metrics.jsonl").read_text().splitlines()
    return [h for h in map(json.loads, lines) if "policy/loss" in h]


@pytest.mark.parametrize(
    "switch",
    [
        (),
        ("trainer.algorithm.recompute_old_logprobs=true",),
        ("trainer.algorithm.use_tis=true", "trainer.algorithm.tis_imp_ratio_cap=2.0"),
    ],
    ids=["engine_old_logprobs", "recompute_old_logprobs", "use_tis"],
)
def test_grpo_logs_the_guard_every_step_with_each_switch(tmp_path, switch) -> None:
    steps = _grpo(tmp_path, *switch)
    assert len(steps) == 2
    for h in steps:  # float32 on the CPU: engine and trainer agree
        assert h[GUARD[0]] < 1e-5 and h[GUARD[2]] == 0.0
        assert h["policy/grad_norm"] > 0
        if "use_tis" in " ".join(switch):
            assert h["policy/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
            assert h["policy/tis_capped_fraction"] == 0.0
        else:
            assert "policy/tis_weight_mean" not in h


def test_tis_without_a_cap_is_refused_as_skyrl_refuses_it() -> None:
    with pytest.raises(ConfigError, match="tis_imp_ratio_cap > 0"):
        load_config(None, ["trainer.algorithm.use_tis=true"])
