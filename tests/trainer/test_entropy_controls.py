"""The entropy floor and the temperature schedule in the GRPO loop: each step's values reach
the rollouts and the update as settings, are logged, and survive a checkpoint and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.tiny import digits_data, digits_policy

from clew.checkpoint.state import Checkpointer
from clew.config import load_config
from clew.data.rows import generate_rows
from clew.rollout.trajectory import Trajectory
from clew.trainer.grpo import GRPOTrainer
from clew.trainer.launch import run_grpo

FLOOR = (
    "trainer.algorithm.use_entropy_loss=true",
    "trainer.algorithm.entropy_loss_coef=0.01",
    "trainer.algorithm.entropy_target=0.3",
    "trainer.algorithm.entropy_coef_step=0.01",
    "trainer.algorithm.entropy_coef_max=0.05",
)


class _Group:
    """A worker group without a model: its update number ``n`` (from 1) reports
    ``entropies[n - 1]`` as ``policy/entropy``; it records the settings it is handed."""

    world_size = 1

    def __init__(self, entropies: list[float]) -> None:
        self.entropies, self.updates = entropies, 0
        self.played: list = []  # each generate's RolloutSettings
        self.trained: list = []  # each update's PPOSettings

    def generate(self, rows, settings, seed, progress=None):
        self.played.append(settings)
        out = []
        for g, row in enumerate(rows):
            for s in range(settings.n_samples_per_prompt):
                t = Trajectory(row.env_id, {}, int(row.seed), g, s)
                t.reward = float(s == 0)
                out.append(t)
        return out

    def update(self, batch, settings):
        self.trained.append(settings)
        self.updates += 1
        return {"policy/optimizer_steps": 1.0, "policy/entropy": self.entropies[self.updates - 1]}

    def state_dict(self) -> dict:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.updates = state["updates"]

    def export(self, path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "policy.txt").write_text("no weights")


class _Loggers:
    def __init__(self) -> None:
        self.records: dict[int, dict] = {}

    def log(self, metrics, step):
        self.records.setdefault(step, {}).update(metrics)


def _trainer(tmp_path: Path, group: _Group, *overrides: str, eval_rows: int = 0):
    base = [
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=1",
        "generator.n_samples_per_prompt=2",
        "trainer.eval_before_train=false",
        "trainer.epochs=1",
        f"trainer.log_path={tmp_path}",
        f"trainer.ckpt_path={tmp_path / 'ckpts'}",
    ]
    cfg = load_config(None, [*base, *overrides])
    rows = generate_rows("maze_2d/small", 32, "train")  # 16 steps of data
    loggers = _Loggers()
    run_dir = tmp_path / "run"
    trainer = GRPOTrainer(
        cfg, group, rows, rows[:eval_rows], loggers, run_dir, Checkpointer(cfg, run_dir)
    )
    return trainer, loggers


def test_the_coefficient_in_effect_follows_the_entropy_and_reaches_the_loss(tmp_path):
    group = _Group([0.1, 0.1, 0.5, 0.1, 0.1])
    trainer, loggers = _trainer(tmp_path, group, *FLOOR, "trainer.max_steps=5")
    trainer.fit()
    # Step 1 starts at entropy_loss_coef; below 0.3 the weight rises by 0.01, above it falls
    # and the bonus is off for the next step (0.5 > 0.3), then resumes at its weight.
    expected = [0.01, 0.02, 0.03, 0.0, 0.03]
    assert [s.entropy_loss_coef for s in group.trained] == pytest.approx(expected)
    logged = [loggers.records[step]["policy/entropy_coef"] for step in range(1, 6)]
    assert logged == pytest.approx(expected)
    assert trainer.state.entropy_coef == pytest.approx(0.04)
    assert trainer.state.last_entropy == 0.1
    assert trainer.cfg.trainer.algorithm.entropy_loss_coef == 0.01  # the config is untouched


def test_the_coefficient_stays_inside_its_bounds(tmp_path):
    group = _Group([0.0] * 8)
    trainer, loggers = _trainer(tmp_path, group, *FLOOR, "trainer.max_steps=8")
    trainer.fit()
    assert [s.entropy_loss_coef for s in group.trained][-4:] == pytest.approx([0.05] * 4)


def test_without_a_target_the_coefficient_is_the_configs(tmp_path):
    group = _Group([0.0] * 3)
    overrides = ("trainer.algorithm.use_entropy_loss=true", "trainer.max_steps=3")
    trainer, loggers = _trainer(tmp_path, group, *overrides)
    trainer.fit()
    assert [s.entropy_loss_coef for s in group.trained] == [0.01] * 3
    assert [loggers.records[s]["policy/entropy_coef"] for s in (1, 2, 3)] == [0.01] * 3
    # And without the bonus, no weight is logged.
    group = _Group([0.0])
    trainer, loggers = _trainer(tmp_path / "off", group, "trainer.max_steps=1")
    trainer.fit()
    assert group.trained[0].entropy_loss_coef == 0.0
    assert "policy/entropy_coef" not in loggers.records[1]


def test_resume_goes_on_with_the_checkpointed_coefficient(tmp_path):
    entropies = [0.1, 0.5, 0.1, 0.1]
    straight = _Group(entropies)
    _trainer(tmp_path / "straight", straight, *FLOOR, "trainer.max_steps=4")[0].fit()

    first = _Group(entropies)
    stopped, _ = _trainer(tmp_path / "resumed", first, *FLOOR, "trainer.max_steps=2")
    stopped.fit()  # the run's end saves its step (ckpt_interval defaults to 10)
    assert (stopped.state.entropy_coef, stopped.state.last_entropy) == (pytest.approx(0.01), 0.5)
    state = torch.load(
        tmp_path / "resumed" / "ckpts" / "global_step_2" / "trainer_state.pt", weights_only=False
    )
    assert state["objects"]["trainer"]["entropy_coef"] == pytest.approx(0.01)
    assert state["objects"]["trainer"]["last_entropy"] == 0.5

    second = _Group(entropies)
    resumed, _ = _trainer(
        tmp_path / "resumed", second, *FLOOR, "trainer.max_steps=4", "trainer.resume_mode=latest"
    )
    resumed.fit()
    assert len(second.trained) == 2  # steps 3 and 4
    # Step 3 follows step 2's entropy above the target: the bonus is off, as in one run.
    coefs = [s.entropy_loss_coef for s in first.trained + second.trained]
    assert coefs == pytest.approx([s.entropy_loss_coef for s in straight.trained])
    assert coefs == pytest.approx([0.01, 0.02, 0.0, 0.02])


def test_an_older_checkpoint_without_the_coefficient_keeps_the_runs_start(tmp_path):
    trainer, _ = _trainer(tmp_path, _Group([]), *FLOOR)
    state = trainer.state_dict()
    del state["entropy_coef"], state["last_entropy"]
    trainer.load_state_dict(state)
    assert (trainer.state.entropy_coef, trainer.state.last_entropy) == (0.01, None)


def test_the_temperature_schedule_reaches_the_rollouts_and_the_update(tmp_path):
    group = _Group([0.5] * 5)
    overrides = (
        "generator.sampling_params.temperature=1.0",
        "generator.sampling_params.temperature_end=0.5",
        "trainer.max_steps=5",
        "trainer.eval_interval=5",
    )
    trainer, loggers = _trainer(tmp_path, group, *overrides, eval_rows=2)
    trainer.fit()
    expected = [1.0, 0.875, 0.75, 0.625, 0.5]  # from step 1 to step 5, the run's last
    train_plays = [s for s in group.played if s.n_samples_per_prompt == 2]
    assert [s.sampling.temperature for s in train_plays] == pytest.approx(expected)
    assert [s.temperature for s in group.trained] == pytest.approx(expected)
    assert [loggers.records[s]["train/temperature"] for s in range(1, 6)] == pytest.approx(expected)
    evaluation = [s for s in group.played if s.n_samples_per_prompt == 1]
    assert evaluation and all(s.sampling.temperature == 0 for s in evaluation)  # greedy
    assert trainer.train_settings.sampling.temperature == 1.0  # the start stays the base


def test_the_schedule_ends_where_the_data_does_when_that_is_before_max_steps(tmp_path):
    group = _Group([0.5] * 16)
    overrides = (
        "generator.sampling_params.temperature=0.6",
        "generator.sampling_params.temperature_end=1.2",
        "trainer.max_steps=100",
    )
    trainer, _ = _trainer(tmp_path, group, *overrides)
    trainer.fit()
    temps = [s.temperature for s in group.trained]
    assert len(temps) == trainer.schedule.total_steps == 16  # 32 rows / 2 a step, one epoch
    assert (temps[0], temps[-1]) == (0.6, 1.2)


def test_without_a_schedule_the_temperature_is_constant(tmp_path):
    group = _Group([0.5] * 2)
    trainer, loggers = _trainer(
        tmp_path, group, "generator.sampling_params.temperature=0.7", "trainer.max_steps=2"
    )
    trainer.fit()
    assert [s.temperature for s in group.trained] == [0.7, 0.7]
    assert [loggers.records[s]["train/temperature"] for s in (1, 2)] == [0.7, 0.7]


# On the tiny model: two real steps with the floor and the schedule on.


def _tiny(root: Path, run: str, *extra: str) -> list[str]:
    return [
        f"data.train_data=['{digits_data(16)}']",
        f"trainer.policy.model.path={digits_policy()}",
        f"trainer.log_path={root / 'runs'}",
        f"trainer.run_name={run}",
        f"trainer.ckpt_path={root / 'ckpts' / run}",
        "trainer.logger=jsonl",
        "trainer.train_batch_size=4",
        "trainer.policy_mini_batch_size=2",
        "trainer.micro_train_batch_size_per_gpu=8",
        "trainer.eval_before_train=false",
        "trainer.hf_save_interval=-1",
        "trainer.policy.optimizer_config.lr=3.0e-3",
        "generator.n_samples_per_prompt=4",
        "generator.max_turns=1",
        "generator.sampling_params.max_generate_length=6",
        "generator.max_input_length=512",
        "trainer.max_prompt_length=128",
        "trainer.algorithm.use_entropy_loss=true",
        "trainer.algorithm.entropy_loss_coef=0.01",
        "trainer.algorithm.entropy_coef_step=0.01",
        *extra,
    ]


def _history(root: Path, run: str) -> dict[int, dict]:
    lines = (root / "runs" / run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    skip = ("timing/", "throughput/", "perf/")
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(skip)} for r in records}


def test_a_tiny_run_adapts_the_coefficient_and_scores_at_the_scheduled_temperature(tmp_path):
    overrides = _tiny(
        tmp_path,
        "floor",
        # Far above any entropy of the tiny policy: the weight rises after every update.
        "trainer.algorithm.entropy_target=100.0",
        "trainer.max_steps=2",
        "trainer.ckpt_interval=-1",
        "generator.sampling_params.temperature=1.0",
        "generator.sampling_params.temperature_end=0.5",
    )
    run_grpo(load_config(None, overrides))
    history = _history(tmp_path, "floor")
    steps = [history[s] for s in (1, 2)]
    assert [h["policy/entropy_coef"] for h in steps] == pytest.approx([0.01, 0.02])
    assert all(h["policy/entropy"] > 0 for h in steps)
    assert [h["train/temperature"] for h in steps] == [1.0, 0.5]
    # The trainer scores the tokens at the temperature the engine sampled them with: its
    # logprobs match the engine's, at 0.5 as at 1.0.
    assert all(h["policy/logprob_diff_max"] < 1e-3 for h in steps)


def test_a_tiny_run_resumed_from_its_checkpoint_matches_the_uninterrupted_one(tmp_path):
    floor = ("trainer.algorithm.entropy_target=100.0", "trainer.ckpt_interval=1")
    run_grpo(load_config(None, _tiny(tmp_path, "straight", *floor, "trainer.max_steps=3")))
    run_grpo(load_config(None, _tiny(tmp_path, "resumed", *floor, "trainer.max_steps=2")))
    resume = ("trainer.max_steps=3", "trainer.resume_mode=latest")
    run_grpo(load_config(None, _tiny(tmp_path, "resumed", *floor, *resume)))
    straight, resumed = _history(tmp_path, "straight"), _history(tmp_path, "resumed")
    assert sorted(straight) == sorted(resumed) == [1, 2, 3]
    assert [resumed[s]["policy/entropy_coef"] for s in (1, 2, 3)] == pytest.approx(
        [0.01, 0.02, 0.03]
    )
    for step in (1, 2, 3):
        assert straight[step] == resumed[step], f"step {step} differs after resume"
