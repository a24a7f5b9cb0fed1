"""DAPO's dynamic sampling: only groups with reward spread reach the update."""

from __future__ import annotations

from pathlib import Path

import pytest

from clew.config import load_config
from clew.data.rows import generate_rows
from clew.errors import ConfigError
from clew.rollout.filtering import batches_needed, spread_groups, spread_per_batch, take_groups
from clew.rollout.trajectory import Trajectory
from clew.trainer.grpo import GRPOTrainer


def _traj(group: int, sample: int, reward: float, turns: int = 1) -> Trajectory:
    t = Trajectory("maze_2d/small", {}, 0, group, sample)
    t.reward, t.turns = reward, turns
    return t


def test_groups_whose_rewards_all_agree_are_dropped_and_the_rest_renumbered():
    trajs = [_traj(7, 0, 1.0), _traj(7, 1, 0.0), _traj(3, 0, 1.0), _traj(3, 1, 1.0)]
    trajs += [_traj(5, 1, 0.0), _traj(5, 0, 0.5)]
    groups = spread_groups(trajs)
    assert [[(t.group_id, t.sample_index) for t in g] for g in groups] == [
        [(7, 0), (7, 1)],
        [(5, 1), (5, 0)],
    ]
    batch = take_groups(groups, 1)
    assert [(t.group_id, t.sample_index) for t in batch] == [(0, 0), (0, 1)]
    batch = take_groups(spread_groups(trajs), 5)
    assert [(t.group_id, t.sample_index) for t in batch] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert spread_groups([]) == []


def test_with_a_turn_discount_a_group_that_all_solved_in_different_turns_has_spread():
    trajs = [_traj(0, 0, 1.0, 9), _traj(0, 1, 1.0, 13), _traj(1, 0, 1.0, 9), _traj(1, 1, 1.0, 9)]
    assert spread_groups(trajs) == []
    assert [[t.sample_index for t in g] for g in spread_groups(trajs, 0.95)] == [[0, 1]]


class _Group:
    """A worker group whose rewards depend on the row: every third row's group has spread."""

    world_size = 1

    def __init__(self) -> None:
        self.played: list[list[int]] = []
        self.updated: list[list[Trajectory]] = []

    def generate(self, rows, settings, seed, progress=None):
        self.played.append([int(r.seed) for r in rows])
        out = []
        for g, row in enumerate(rows):
            for s in range(settings.n_samples_per_prompt):
                reward = float(s == 0) if int(row.seed) % 3 == 0 else 0.0
                t = Trajectory(row.env_id, {}, int(row.seed), g, s)
                t.reward = reward
                out.append(t)
        return out

    def update(self, batch, settings):
        self.updated.append(list(batch.sequences))
        return {}


class _Loggers:
    def __init__(self) -> None:
        self.logged: list[dict] = []

    def log(self, metrics, step):
        self.logged.append(dict(metrics))


def _run(tmp_path: Path, *overrides: str) -> tuple[_Group, _Loggers, GRPOTrainer]:
    cfg = load_config(
        None,
        [
            "trainer.train_batch_size=4",
            "trainer.policy_mini_batch_size=4",
            "trainer.micro_train_batch_size_per_gpu=2",
            "trainer.micro_forward_batch_size_per_gpu=2",
            "generator.n_samples_per_prompt=2",
            "trainer.eval_before_train=false",
            "trainer.max_steps=2",
            "trainer.epochs=1",
            *overrides,
        ],
    )
    group, loggers = _Group(), _Loggers()
    rows = generate_rows("maze_2d/small", 96, "train")
    trainer = GRPOTrainer(cfg, group, rows, [], loggers, tmp_path)
    trainer.fit()
    return group, loggers, trainer


def test_filter_plays_batches_until_enough_groups_have_spread(tmp_path):
    group, loggers, trainer = _run(tmp_path, "trainer.algorithm.dynamic_sampling.type=filter")
    for batch in group.updated:
        assert len(batch) == 4 * 2
        assert sorted({t.group_id for t in batch}) == [0, 1, 2, 3]
        assert all(int(t.seed) % 3 == 0 for t in batch)
    played = sum(len(p) for p in group.played)
    assert played > 2 * 4  # more prompts than two plain steps would play
    steps = [m for m in loggers.logged if "train/dynamic_sampling/batches" in m]
    assert sum(m["train/dynamic_sampling/batches"] for m in steps) * 4 == played
    assert all(m["train/dynamic_sampling/kept_groups"] == 4 for m in steps)
    # The rollout metrics cover every episode played, not only the kept ones.
    assert all(m["train/solve_rate"] < 0.5 for m in steps)
    # The sampler moved past every batch played: a resumed run goes on after them.
    assert trainer.sampler.position * 4 == played


def test_the_next_step_plays_as_many_batches_at_once_as_the_last_one_needed(tmp_path):
    group, loggers, _ = _run(tmp_path, "trainer.algorithm.dynamic_sampling.type=filter")
    first = int(
        next(m for m in loggers.logged if "train/dynamic_sampling/batches" in m)[
            "train/dynamic_sampling/batches"
        ]
    )
    assert [len(p) for p in group.played[:first]] == [4] * first  # one batch a play at first
    spread = [sum(seed % 3 == 0 for seed in p) for p in group.played[:first]]
    needed = batches_needed(spread, 4)
    assert needed > 1
    assert len(group.played[first]) == 4 * needed  # then that many batches in one play


def test_batches_needed_counts_spread_groups_batch_by_batch():
    groups = [[_traj(g, 0, 1.0), _traj(g, 1, 0.0)] for g in (0, 2, 5, 9, 11)]
    assert spread_per_batch(groups, 3, 4) == [2, 1, 2]
    assert batches_needed([2, 1, 2], 3) == 2
    assert batches_needed([2, 1, 2], 5) == 3
    assert batches_needed([2, 1, 2], 9) == 3  # never reached: all of them
    assert batches_needed([], 1) == 1


def test_filter_at_its_batch_limit_updates_on_what_it_found(tmp_path):
    group, loggers, _ = _run(
        tmp_path,
        "trainer.algorithm.dynamic_sampling.type=filter",
        "trainer.algorithm.dynamic_sampling.max_sample_batches=1",
    )
    steps = [m for m in loggers.logged if "train/dynamic_sampling/batches" in m]
    assert all(m["train/dynamic_sampling/batches"] == 1 for m in steps)
    assert [len({t.group_id for t in b}) for b in group.updated] == [
        m["train/dynamic_sampling/kept_groups"]
        for m in steps
        if m["train/dynamic_sampling/kept_groups"]
    ]


def test_without_the_filter_every_group_is_updated_on(tmp_path):
    group, _, _ = _run(tmp_path)
    assert [len(b) for b in group.updated] == [8, 8] and len(group.played) == 2


def test_an_unknown_dynamic_sampling_type_names_the_accepted_one():
    with pytest.raises(ConfigError, match="filter"):
        load_config(None, ["trainer.algorithm.dynamic_sampling.type=replace"])


class _SolvingGroup(_Group):
    """Every sample solves; sample s takes 5 + 4 s turns. Records the update's advantages."""

    def __init__(self) -> None:
        super().__init__()
        self.advantages: list = []

    def generate(self, rows, settings, seed, progress=None):
        out = super().generate(rows, settings, seed)
        for t in out:
            t.reward, t.turns = 1.0, 5 + 4 * t.sample_index
        return out

    def update(self, batch, settings):
        self.advantages.append(batch.advantages)
        return super().update(batch, settings)


def test_the_update_learns_from_turn_discounted_rewards_while_metrics_keep_the_envs(tmp_path):
    cfg = load_config(
        None,
        [
            "trainer.train_batch_size=2",
            "trainer.policy_mini_batch_size=2",
            "trainer.micro_train_batch_size_per_gpu=2",
            "trainer.micro_forward_batch_size_per_gpu=2",
            "generator.n_samples_per_prompt=2",
            "trainer.eval_before_train=false",
            "trainer.max_steps=1",
            "trainer.algorithm.turn_discount=0.9",
        ],
    )
    group, loggers = _SolvingGroup(), _Loggers()
    GRPOTrainer(cfg, group, generate_rows("maze_2d/small", 8, "train"), [], loggers, tmp_path).fit()
    (adv,) = group.advantages
    assert adv.tolist() == pytest.approx([0.7071, -0.7071, 0.7071, -0.7071], abs=1e-3)
    step = next(m for m in loggers.logged if "train/solve_rate" in m)
    assert step["train/solve_rate"] == 1.0 and step["train/zero_spread_groups"] == 0.0


def test_a_turn_discount_outside_zero_one_names_the_range():
    with pytest.raises(ConfigError, match="turn_discount"):
        load_config(None, ["trainer.algorithm.turn_discount=1.5"])
