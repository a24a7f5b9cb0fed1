"""Where a run's work goes, without Ray: rollout rows spread over workers by expected cost,
and a cluster address that does not answer refused within seconds."""

from __future__ import annotations

import json
import socket
import time

import pytest

from clew.cluster.balance import assign_rows, expected_cost
from clew.config import load_config
from clew.data.rows import Row
from clew.errors import ClewError, ConfigError
from clew.ray_connect import connect_ray


def row(turns_needed: int | None, max_turns: int = 10) -> Row:
    facts = {} if turns_needed is None else {"turns_needed": turns_needed}
    return Row("test/digits", "{}", 0, "train", "", max_turns, json.dumps(facts))


def test_a_rows_expected_cost_is_the_turns_its_expert_needs_within_its_budget():
    assert expected_cost(row(3)) == 3
    assert expected_cost(row(30)) == 10  # an episode stops at its turn budget
    assert expected_cost(row(None)) == 10  # unknown: the whole budget


def test_rows_go_to_workers_longest_first_to_the_least_loaded():
    costs = [1, 9, 1, 1, 4, 4, 1, 1]
    parts = assign_rows(costs, 2)
    assert sorted(i for p in parts for i in p) == list(range(8))  # every row once
    assert all(p == sorted(p) for p in parts)
    loads = sorted(sum(costs[i] for i in p) for p in parts)
    assert loads == [11, 11]  # contiguous halves would load 12 and 10


def test_rows_of_equal_cost_go_in_contiguous_count_balanced_chunks():
    assert assign_rows([2.0] * 5, 2) == [[0, 1, 2], [3, 4]]
    assert assign_rows([1.0] * 2, 3) == [[0], [1]]  # fewer rows than workers: none left empty
    assert assign_rows([], 4) == []
    assert assign_rows([5.0, 1.0], 1) == [[0, 1]]


def test_a_ray_address_that_does_not_answer_fails_fast_saying_so(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    begun = time.monotonic()
    with pytest.raises(ClewError, match=rf"RAY_ADDRESS=127.0.0.1:{port} does not answer"):
        connect_ray(None)
    assert time.monotonic() - begun < 15


def test_one_gpu_on_a_cluster_from_a_driver_without_gpus_goes_to_a_ray_gpu_worker(monkeypatch):
    # A `ray job submit` entrypoint runs on the head node, usually a CPU node: its one GPU
    # worker must be a Ray actor on a GPU node, not this process on its CPU. A cluster of CPU
    # nodes keeps the run in this process, unless trainer.device=cuda asks for a GPU.
    import clew.trainer.launch as launch

    cluster_gpus = {"GPU": 2.0, "CPU": 8.0}
    monkeypatch.setattr(launch, "local_gpus", lambda: 0)
    monkeypatch.setattr(launch, "connect_ray", lambda num_cpus: False)
    monkeypatch.setattr("ray.cluster_resources", lambda: dict(cluster_gpus))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    device, on_gpus = launch.placement_device(load_config(None, []))
    assert (device.type, on_gpus) == ("cuda", True)
    for override in ("trainer.device=cpu", "trainer.placement.num_cpu_workers=2"):
        device, on_gpus = launch.placement_device(load_config(None, [override]))
        assert (device.type, on_gpus) == ("cpu", False), override
    cluster_gpus.pop("GPU")
    device, on_gpus = launch.placement_device(load_config(None, []))
    assert (device.type, on_gpus) == ("cpu", False)
    with pytest.raises(ConfigError, match=r"the Ray cluster has 0"):
        launch.placement_device(load_config(None, ["trainer.device=cuda"]))
    monkeypatch.delenv("RAY_ADDRESS")
    device, on_gpus = launch.placement_device(load_config(None, []))
    assert not on_gpus and not launch.uses_ray(load_config(None, []), on_gpus)


def test_a_gpu_placement_on_a_cluster_without_gpus_is_refused_naming_the_cpu_way():
    from clew.cluster.placement import check_gpus
    from clew.trainer.launch import placement_settings

    settings = placement_settings(load_config(None, []).trainer.placement)
    with pytest.raises(ConfigError, match=r"has 0: .*trainer\.device=cpu"):
        check_gpus(settings, 0, "the Ray cluster")


def test_any_mini_batch_splits_over_cpu_workers_and_the_micro_batch_rule_names_no_gpus():
    # 3 workers and a mini-batch of 8 prompts x 8 samples: shares of 22, 21 and 21.
    three = load_config(None, ["trainer.placement.num_cpu_workers=3"])
    trainer = three.trainer
    assert (trainer.placement.num_workers, trainer.policy_mini_batch_size) == (3, 8)
    two = ["trainer.placement.num_cpu_workers=2", "generator.n_samples_per_prompt=3"]
    load_config(None, [*two, "trainer.policy_mini_batch_size=1", "trainer.train_batch_size=1"])
    with pytest.raises(ConfigError) as err:
        load_config(None, [*two, "trainer.micro_train_batch_size_per_gpu=5"])
    message = str(err.value)
    assert "[micro-batch-divisible] a mini batch of 24 trajectories" in message
    assert "micro_train_batch_size_per_gpu (5)" in message and "1, 2, 3, 4, 6, 8, 12, 24" in message
    assert "GPU" not in message.replace("micro_train_batch_size_per_gpu", "")


def test_skyrls_placement_timeout_variable_is_the_default_and_the_key_wins(monkeypatch):
    monkeypatch.setenv("SKYRL_RAY_PG_TIMEOUT_IN_S", "600")  # the walkthrough's train_job.sh
    unset = load_config(None, []).trainer.placement
    assert unset.timeout_s is None
    assert unset.placement_timeout() == (
        600.0,
        "SKYRL_RAY_PG_TIMEOUT_IN_S (trainer.placement.timeout_s unset)",
    )
    key = load_config(None, ["trainer.placement.timeout_s=30"]).trainer.placement
    assert key.placement_timeout() == (30.0, "trainer.placement.timeout_s")
    monkeypatch.delenv("SKYRL_RAY_PG_TIMEOUT_IN_S")
    assert unset.placement_timeout()[0] == 120.0
    for bad in ("ten", "0", "-5", "nan"):
        monkeypatch.setenv("SKYRL_RAY_PG_TIMEOUT_IN_S", bad)
        with pytest.raises(ConfigError, match=rf"SKYRL_RAY_PG_TIMEOUT_IN_S='{bad}'.*positive"):
            unset.placement_timeout()
