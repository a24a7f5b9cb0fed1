"""GRPO on CPU workers on Ray: a run end to end, rollouts spread over workers, the desync
check, a GPU placement refused on a machine without the GPUs, and a run that loses a worker
going on from its checkpoint on a new worker group."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from envs_for_tests import digits_rows, ray_runtime_env
from support.tiny import digits_data

from clew.config import load_config
from clew.data.rows import generate_rows, write_rows
from clew.errors import ClewError, ConfigError
from clew.inference.sampling import SamplingParams
from clew.metrics import read_history
from clew.rollout.loop import RolloutSettings
from clew.train.settings import PPOSettings, WorkerSettings
from clew.train.training_batch import TrainingBatch
from clew.trainer.grpo import GRPOTrainer
from clew.trainer.launch import run_grpo
from clew.trainer.sft_launch import run_sft_stage

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("one_thread")]

LORA = WorkerSettings(lora_rank=4, lr=1e-3)
ROLLOUTS = RolloutSettings(2, 1, 256, SamplingParams(max_tokens=4))


@pytest.fixture(scope="module")
def ray_local():
    """One Ray instance on loopback for the module; its workers know the test envs."""
    ray = pytest.importorskip("ray")
    from clew.ray_connect import start_local_ray

    # A Ray of the module's own on loopback, whatever cluster the machine has or had.
    start_local_ray(2, log_to_driver=False, runtime_env=ray_runtime_env())
    yield ray
    ray.shutdown()


def _config(tmp_path: Path, model: Path, *overrides: str):
    return load_config(
        None,
        [
            f"data.train_data=['{digits_data(8)}']",
            f"data.val_data=['{digits_data(3, 'eval')}']",
            f"trainer.policy.model.path={model}",
            f"trainer.log_path={tmp_path / 'runs'}",
            "trainer.run_name=dp",
            "trainer.logger=jsonl",
            "trainer.eval_before_train=false",
            "trainer.max_steps=2",
            "trainer.eval_interval=2",
            "trainer.ckpt_interval=2",
            "trainer.dump_eval_results=true",
            "trainer.train_batch_size=2",
            "trainer.policy_mini_batch_size=2",
            "trainer.micro_train_batch_size_per_gpu=1",
            "trainer.max_prompt_length=128",
            "trainer.policy.model.lora.rank=4",
            "generator.n_samples_per_prompt=2",
            "generator.max_turns=1",
            "generator.sampling_params.max_generate_length=4",
            "generator.eval_sampling_params.max_generate_length=4",
            "generator.max_input_length=256",
            *overrides,
        ],
    )


def test_grpo_on_two_cpu_workers_trains_evaluates_checkpoints_and_exports(
    ray_local, digits_model_dir, tmp_path
):
    run_grpo(_config(tmp_path, digits_model_dir, "trainer.placement.num_cpu_workers=2"))
    run = tmp_path / "runs" / "dp"
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [h for h in history if "policy/optimizer_steps" in h]
    assert len(trained) == 2 and all(h["policy/optimizer_steps"] >= 1 for h in trained)
    assert any("eval/all/pass_at_1" in h for h in history)
    assert (run / "ckpts" / "global_step_2").is_dir()
    assert (run / "exports" / "global_step_2" / "policy").is_dir()
    # Evaluation went through both workers: 3 rows, one greedy episode each, in row order.
    dumped = next(run.rglob("trajectories.jsonl")).read_text().splitlines()
    records = [json.loads(line) for line in dumped]
    assert [(r["group_id"], r["seed"]) for r in records] == [(0, 0), (1, 1), (2, 2)]


def test_gpu_workers_asked_for_on_a_machine_without_them_are_refused_before_any_work(
    digits_model_dir, tmp_path, monkeypatch
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = _config(tmp_path, digits_model_dir, "trainer.placement.policy_num_gpus_per_node=2")
    with pytest.raises(ConfigError) as err:
        run_grpo(cfg)
    message = str(err.value)
    assert "policy_num_gpus_per_node" in message and "2 GPUs asked" in message
    assert "this machine has 0" in message and "num_cpu_workers" in message
    assert not (tmp_path / "runs" / "dp" / "metrics.jsonl").exists()


def _kill_a_worker_after(step: int, monkeypatch) -> None:
    """Kill worker 1's actor once, right after ``step`` is logged (before its checkpoint)."""
    ray = pytest.importorskip("ray")
    original = GRPOTrainer.log
    killed: list[int] = []

    def log(self, logged: int) -> None:
        original(self, logged)
        if logged == step and not killed:
            killed.append(logged)
            victim = self.group.workers[1]
            ray.kill(victim)
            for _ in range(300):  # dead before the run goes on (the kill is asynchronous)
                try:
                    ray.get(victim.__ray_ready__.remote(), timeout=30)
                except ray.exceptions.RayActorError:
                    break
                time.sleep(0.1)
            else:
                pytest.fail("the killed worker still answers")

    monkeypatch.setattr(GRPOTrainer, "log", log)


def _history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _exported(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted((run / "exports" / "global_step_4" / "policy").rglob("*.safetensors"))
    assert files
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(f).items()}


def test_a_killed_worker_is_replaced_and_the_run_ends_as_an_undisturbed_one(
    ray_local, digits_model_dir, tmp_path, monkeypatch, capsys
):
    steps = ("trainer.max_steps=4", "trainer.ckpt_interval=1", "trainer.eval_interval=4")
    workers = "trainer.placement.num_cpu_workers=2"
    run_grpo(_config(tmp_path, digits_model_dir, workers, *steps, "trainer.run_name=calm"))
    _kill_a_worker_after(2, monkeypatch)
    run_grpo(_config(tmp_path, digits_model_dir, workers, *steps, "trainer.run_name=killed"))
    out = capsys.readouterr().out
    assert "died" in out and "restart 1 of 3" in out and "global step 2" in out
    calm, killed = _history(tmp_path / "runs" / "calm"), _history(tmp_path / "runs" / "killed")
    # Steps 1-2 logged before the kill, 3-4 after the restart (from step 2's checkpoint).
    assert [h.get("train/restarts") for h in killed if "timing/step" in h] == [0, 0, 1, 1]
    assert [h["step"] for h in killed] == [h["step"] for h in calm]  # one run's history
    final_calm = {k: v for k, v in calm[-1].items() if k.startswith("eval/")}
    final_killed = {k: v for k, v in killed[-1].items() if k.startswith("eval/")}
    assert final_calm and final_killed == pytest.approx(final_calm)
    want, got = _exported(tmp_path / "runs" / "calm"), _exported(tmp_path / "runs" / "killed")
    assert want.keys() == got.keys()
    assert all(torch.allclose(want[k], got[k]) for k in want)


def test_a_run_out_of_restarts_fails_naming_them_and_the_cause(
    ray_local, digits_model_dir, tmp_path, monkeypatch
):
    _kill_a_worker_after(1, monkeypatch)
    cfg = _config(
        tmp_path, digits_model_dir, "trainer.placement.num_cpu_workers=2", "trainer.max_restarts=0"
    )
    with pytest.raises(ClewError, match=r"after 0 restart\(s\).*max_restarts=0.*died"):
        run_grpo(cfg)


def test_a_worker_that_cannot_load_the_policy_fails_the_run_naming_it_and_the_cause(
    ray_local, tmp_path, capsys
):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    cfg = _config(tmp_path, empty, "trainer.placement.num_cpu_workers=2")
    with pytest.raises(ClewError) as err:
        run_grpo(cfg)
    message = str(err.value)
    assert re.search(r"worker [01] of 2 could not start: .*could not load the policy", message)
    assert str(empty) in message and "Traceback" not in message
    assert "restart" not in capsys.readouterr().out  # the same error would only come again


def test_envs_of_a_module_named_in_the_config_reach_the_ray_workers(
    ray_local, digits_model_dir, tmp_path, monkeypatch
):
    (tmp_path / "plugin_envs.py").write_text(
        "from envs_for_tests import DigitsEnv\n"
        "from clew.envs import register\n"
        "register('plugin/digits', DigitsEnv, accepted_options=set())\n"
    )
    monkeypatch.chdir(tmp_path)
    tests = str(Path(__file__).parents[1])  # the workers' PYTHONPATH keeps the test envs
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    rows = [dataclasses.replace(r, env_id="plugin/digits") for r in digits_rows(4)]
    write_rows(rows, tmp_path / "plugin.parquet")
    cfg = _config(
        tmp_path,
        digits_model_dir,
        "trainer.placement.num_cpu_workers=2",
        f"data.train_data=['{tmp_path / 'plugin.parquet'}']",
        "data.val_data=[]",
        "trainer.max_steps=1",
        "environment.modules=[plugin_envs]",
    )
    run_grpo(cfg)
    history = _history(tmp_path / "runs" / "dp")
    assert any("policy/optimizer_steps" in h for h in history)
    with pytest.raises(ClewError, match=r"could not import environment module 'no_such_envs'"):
        run_grpo(
            cfg.model_copy(
                update={
                    "environment": cfg.environment.model_copy(update={"modules": ["no_such_envs"]})
                }
            )
        )


@pytest.mark.timeout(300)
def test_a_sharded_policy_evaluates_fewer_rows_than_workers_without_hanging(
    ray_local, digits_model_dir, tmp_path
):
    write_rows(digits_rows(1, "eval"), tmp_path / "one.parquet")
    cfg = _config(
        tmp_path,
        digits_model_dir,
        "trainer.placement.num_cpu_workers=2",
        "trainer.policy.model.lora.rank=0",
        "trainer.strategy=fsdp",
        f"data.val_data=['{tmp_path / 'one.parquet'}']",
        "trainer.max_steps=1",
        "trainer.eval_interval=1",
    )
    run_grpo(cfg)
    history = _history(tmp_path / "runs" / "dp")
    assert any("eval/all/pass_at_1" in h for h in history)


def test_sft_on_two_cpu_workers_takes_the_steps_of_one_worker(
    ray_local, digits_model_dir, tmp_path
):
    write_rows(generate_rows("test/line", 6), tmp_path / "line.parquet")
    write_rows(generate_rows("test/line", 2, "eval"), tmp_path / "line-eval.parquet")

    def sft(workers: int):
        cfg = load_config(
            None,
            [
                f"sft.model_path={digits_model_dir}",
                f"data.train_data=['{tmp_path / 'line.parquet'}']",
                f"data.val_data=['{tmp_path / 'line-eval.parquet'}']",
                f"trainer.log_path={tmp_path / f'runs{workers}'}",
                "trainer.logger=jsonl",
                "trainer.strategy=ddp",
                f"trainer.placement.num_cpu_workers={workers}",
                "sft.steps=4",
                "sft.batch_size=3",
                "sft.eval_interval=4",
                "sft.dagger.interval=2",
                "sft.dagger.rows=2",
                "sft.optimizer_config.lr=1e-3",
            ],
        )
        return run_sft_stage(cfg)

    one, two = sft(1), sft(2)
    h1, h2 = read_history(one.run_dir), read_history(two.run_dir)
    assert [h["step"] for h in h1] == [h["step"] for h in h2] == [1, 2, 3, 4]
    assert any("sft/dagger_demonstrations" in h for h in h2)  # a DAgger round ran on Ray
    for a, b in zip(h1, h2, strict=True):
        assert b["sft/loss"] == pytest.approx(a["sft/loss"], rel=1e-4)
        assert ("sft/dagger_demonstrations" in a) == ("sft/dagger_demonstrations" in b)
    assert two.last_eval == pytest.approx(one.last_eval) and "eval/all/pass_at_1" in two.last_eval
    from safetensors.torch import load_file

    w1 = load_file(Path(one.final_policy) / "model.safetensors")
    w2 = load_file(Path(two.final_policy) / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=2e-5, rtol=0)


# The runs above take the instance's 2 CPUs for their workers: they must come before the
# module's `group`, which holds both until the module ends.


@pytest.fixture(scope="module")
def group(ray_local, digits_model_dir):
    from clew.cluster.ray_group import RayWorkerGroup

    g = RayWorkerGroup(digits_model_dir, LORA, num_workers=2)
    yield g
    g.shutdown()


def test_rollouts_spread_over_workers_come_back_in_row_order_with_batch_wide_group_ids(group):
    rows = digits_rows(5)
    trajs = group.generate(rows, ROLLOUTS, seed=3)
    assert [(t.group_id, t.sample_index, t.seed) for t in trajs] == [
        (g, s, g) for g in range(5) for s in range(2)
    ]


def test_a_worker_whose_weights_drift_stops_the_update_naming_it(group):
    trajs = group.generate(digits_rows(2), ROLLOUTS, seed=0)
    batch = TrainingBatch.from_trajectories(trajs, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    settings = PPOSettings(mini_batch_size=4, micro_batch_size=2)
    state = group.state_dict()
    state["trainable"] = {k: v + 0.01 for k, v in state["trainable"].items()}
    ray = pytest.importorskip("ray")
    ray.get(group.workers[1].load_state_dict.remote(state))
    with pytest.raises(ClewError, match=r"weight desync.*worker\(s\) \[1\].*worker 1: "):
        group.update(batch, settings)


def test_an_error_in_a_workers_code_is_not_taken_for_a_lost_worker(group):
    from clew.cluster.ray_calls import WorkerLost

    with pytest.raises(Exception) as err:
        group.load_state_dict({})
    assert not isinstance(err.value, WorkerLost)
    assert group.trainable_fingerprints()  # both workers still answer


def test_workers_the_busy_cluster_cannot_place_fail_after_the_timeout_saying_what_is_free(
    group, digits_model_dir, tmp_path
):
    cfg = _config(
        tmp_path,
        digits_model_dir,
        "trainer.placement.num_cpu_workers=2",
        "trainer.placement.timeout_s=2",
    )
    with pytest.raises(ClewError, match=r"could not place 2 CPU workers.*timeout_s = 2 s.*0 free"):
        run_grpo(cfg)


def test_more_cpu_workers_than_the_cluster_has_are_refused_at_once(
    group, digits_model_dir, tmp_path
):
    three = ("trainer.train_batch_size=3", "trainer.policy_mini_batch_size=3")
    cfg = _config(tmp_path, digits_model_dir, "trainer.placement.num_cpu_workers=3", *three)
    with pytest.raises(ConfigError, match=r"num_cpu_workers = 3 CPU workers asked.*has 2 CPUs"):
        run_grpo(cfg)
