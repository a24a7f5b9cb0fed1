"""Data-parallel PPO: N workers with summed gradients take the step one worker takes."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from clew.train import PolicyWorker, PPOSettings, WorkerSettings
from clew.train.model_batch import Sample
from clew.train.training_batch import TrainingBatch, share_sizes

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("one_thread")]

LORA = WorkerSettings(lora_rank=4, lr=1e-3, max_grad_norm=0.5)
REDUCTIONS = ["token_mean", "sequence_mean"]


class ThreadSync:
    """An all-reduce between the threads of this process, one ``member`` per worker."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: list = [None] * n

    def _sum(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = self.slots[0]
        for v in self.slots[1:]:
            out = (
                out + v if not isinstance(v, list) else [a + b for a, b in zip(out, v, strict=True)]
            )
        self.barrier.wait()
        return out

    def member(self, rank: int):
        sync = self

        class Member:
            def total(self, x: float) -> float:
                return sync._sum(rank, float(x))

            def reduce_(self, params) -> None:
                grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
                for p, g in zip(params, sync._sum(rank, grads), strict=True):
                    p.grad = g

        return Member()


def trainable(state: dict) -> dict[str, torch.Tensor]:
    return state["trainable"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture(scope="module")
def start(model_dir) -> dict:
    """The state every worker starts from (a LoRA adapter with its random init)."""
    torch.manual_seed(0)
    return PolicyWorker.from_pretrained(model_dir, LORA).state_dict()


def fresh(model_dir, start: dict) -> PolicyWorker:
    worker = PolicyWorker.from_pretrained(model_dir, LORA)
    worker.load_state_dict(start)
    return worker


@pytest.fixture(scope="module")
def batch(model_dir, chat, start) -> TrainingBatch:
    """8 text sequences of different lengths; with 2 workers and mini-batches of 4, worker 1's
    share of the second mini-batch (sequences 6, 7) has no loss token at all."""
    tok = chat.processor.tokenizer
    seqs = []
    for i in range(8):
        ids = tok(f"go {'left ' * (i % 3)}then up {i}", add_special_tokens=False)["input_ids"]
        n_reply = 0 if i >= 6 else 1 + i % 3
        seqs.append(Sample(ids, [0] * (len(ids) - n_reply) + [1] * n_reply))
    old = fresh(model_dir, start).compute_logprobs(seqs)
    old = [lp - 0.3 * (i % 2) for i, lp in enumerate(old)]  # off-policy: some tokens clip
    return TrainingBatch(seqs, torch.tensor([1.0, -1.0, 0.5, 2.0, -0.5, 1.5, 1.0, -2.0]), old)


def one_worker(model_dir, start, batch, settings) -> tuple[dict, dict]:
    worker = fresh(model_dir, start)
    metrics = worker.train_batch(batch, settings)
    weights = trainable(worker.state_dict())
    moved = max((weights[k] - trainable(start)[k]).abs().max().item() for k in weights)
    assert moved > 1e-4  # far past the tolerance the workers are compared with
    return weights, metrics


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_two_synced_workers_take_the_step_of_one_worker(model_dir, start, batch, reduction):
    settings = PPOSettings(loss_reduction=reduction, mini_batch_size=4, micro_batch_size=2)
    expected, metrics = one_worker(model_dir, start, batch, settings)
    shares = batch.split(2, 4)
    sync = ThreadSync(2)
    workers = [fresh(model_dir, start) for _ in range(2)]
    results: list = [None, None]

    def run(rank: int) -> None:
        workers[rank].sync = sync.member(rank)
        per_worker = PPOSettings(loss_reduction=reduction, mini_batch_size=2, micro_batch_size=2)
        results[rank] = workers[rank].train_batch(shares[rank], per_worker)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None for r in results), "a worker failed or hung"
    for w in workers:
        assert_same_weights(trainable(w.state_dict()), expected)
    for r in results:
        assert r["policy/optimizer_steps"] == metrics["policy/optimizer_steps"] == 2
        assert r["policy/loss"] == pytest.approx(metrics["policy/loss"], abs=1e-6)
        assert r["policy/grad_norm"] == pytest.approx(metrics["policy/grad_norm"], rel=1e-5)


@pytest.mark.parametrize(("workers", "mini"), [(2, 3), (3, 2)])
def test_workers_given_uneven_or_empty_shares_take_the_step_of_one_worker(
    model_dir, start, batch, workers, mini
):
    """Mini-batches of 3 over 2 workers split 2/1; of 2 over 3 workers leave worker 2 with
    nothing at all, yet it joins every optimizer step."""
    settings = PPOSettings(mini_batch_size=mini, micro_batch_size=1)
    expected, metrics = one_worker(model_dir, start, batch, settings)
    shares = batch.split(workers, mini)
    sizes = share_sizes(len(batch), mini, workers)
    assert any(s == 0 for row in sizes for s in row) == (workers > mini)
    sync = ThreadSync(workers)
    replicas = [fresh(model_dir, start) for _ in range(workers)]
    results: list = [None] * workers

    def run(rank: int) -> None:
        replicas[rank].sync = sync.member(rank)
        mine = dataclasses.replace(settings, mini_batch_sizes=tuple(sizes[rank]))
        results[rank] = replicas[rank].train_batch(shares[rank], mine)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None for r in results), "a worker failed or hung"
    for w in replicas:
        assert_same_weights(trainable(w.state_dict()), expected)
    steps = metrics["policy/optimizer_steps"]
    assert all(r["policy/optimizer_steps"] == steps for r in results)


@pytest.fixture(scope="module")
def ray_group(model_dir):
    ray = pytest.importorskip("ray")
    from clew.cluster.ray_group import RayWorkerGroup
    from clew.ray_connect import start_local_ray

    # A Ray of the test's own on loopback, whatever cluster the machine has or had.
    start_local_ray(2, log_to_driver=False)
    group = RayWorkerGroup(model_dir, LORA, num_workers=2)
    yield group
    group.shutdown()
    ray.shutdown()


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_two_ray_workers_take_the_step_of_one_worker(ray_group, model_dir, start, batch, reduction):
    settings = PPOSettings(loss_reduction=reduction, mini_batch_size=4, micro_batch_size=2)
    expected, metrics = one_worker(model_dir, start, batch, settings)
    ray_group.load_state_dict(start)
    got = ray_group.update(batch, settings)
    assert_same_weights(trainable(ray_group.state_dict()), expected)
    a, b = ray_group.trainable_fingerprints()
    assert a == b
    assert got["policy/optimizer_steps"] == 2
    assert got["policy/loss"] == pytest.approx(metrics["policy/loss"], abs=1e-6)


def test_a_group_whose_rendezvous_port_was_taken_starts_again_on_another(
    ray_group, model_dir, monkeypatch, capsys
):
    import socket

    from clew.cluster import ray_group as module
    from clew.cluster.ray_group import RayWorkerGroup
    from clew.train.grad_sync import free_loopback_address

    with socket.socket() as held:  # another process took the port after it was chosen
        held.bind(("127.0.0.1", 0))
        held.listen()
        addresses = [f"tcp://127.0.0.1:{held.getsockname()[1]}", free_loopback_address()]
        tried: list[str] = []
        monkeypatch.setattr(
            module, "local_rendezvous", lambda: tried.append(addresses[len(tried)]) or tried[-1]
        )
        group = RayWorkerGroup(
            model_dir, LORA, num_workers=2, num_cpus_per_worker=0, timeout_s=60, name="port"
        )
    try:
        assert tried == addresses and group.rendezvous == addresses[1]
        a, b = group.trainable_fingerprints()
        assert a == b
        assert "EADDRINUSE" in capsys.readouterr().out  # it said why it started again
    finally:
        group.shutdown()
