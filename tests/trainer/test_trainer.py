"""End to end on the tiny model: the GRPO loop raises the training reward."""

from __future__ import annotations

import json

import pytest
import torch
from envs_for_tests import digits_rows, walk_rows
from support.tiny import tiny_policy

from clew.config import load_config
from clew.data.rows import generate_rows, write_rows
from clew.errors import ClewError
from clew.rollout.trajectory import Trajectory
from clew.train.settings import PPOSettings
from clew.train.training_batch import TrainingBatch
from clew.trainer.grpo import GRPOTrainer
from clew.trainer.launch import run_grpo


def _tiny_run(tmp_path, rows, corpus: str, run: str, *overrides: str) -> list[dict]:
    """Train the tiny model on ``rows`` with ``overrides``; the run's metrics, one per line."""
    write_rows(rows, tmp_path / "train.parquet")
    cfg = load_config(
        None,
        [
            f"data.train_data=['{tmp_path / 'train.parquet'}']",
            f"trainer.policy.model.path={tiny_policy(corpus=[corpus * 20], image_size=28)}",
            f"trainer.log_path={tmp_path / 'runs'}",
            f"trainer.run_name={run}",
            "trainer.logger=jsonl",
            "trainer.eval_before_train=false",
            "trainer.ckpt_interval=-1",
            "trainer.max_prompt_length=128",
            *overrides,
        ],
    )
    run_grpo(cfg)
    lines = (tmp_path / "runs" / run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_grpo_raises_the_training_reward(tmp_path):
    history = _tiny_run(
        tmp_path,
        digits_rows(64),
        "0123456789 ",
        "digits",
        "trainer.train_batch_size=4",
        "trainer.policy_mini_batch_size=4",
        "trainer.micro_train_batch_size_per_gpu=32",
        "trainer.epochs=4",
        "trainer.policy.optimizer_config.lr=3.0e-3",
        "trainer.policy.optimizer_config.weight_decay=0.0",
        "generator.n_samples_per_prompt=8",
        "generator.max_turns=1",
        "generator.sampling_params.max_generate_length=6",
        "generator.max_input_length=512",
    )
    rewards = [h["train/reward_mean"] for h in history if "train/reward_mean" in h]
    assert len(rewards) == 64
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.2, f"reward went from {first:.3f} to {last:.3f}"
    assert (tmp_path / "runs" / "digits" / "config.yaml").is_file()
    policy = tmp_path / "runs" / "digits" / "exports" / "global_step_64" / "policy"
    # a standard Hugging Face directory: the architecture's own processor class
    processor = json.loads((policy / "processor_config.json").read_text())
    assert processor["processor_class"] in ("Qwen2VLProcessor", "Qwen3VLProcessor")
    assert (policy / "preprocessor_config.json").is_file()


def test_gigpo_updates_each_turn_with_its_own_advantage_end_to_end(tmp_path):
    history = _tiny_run(
        tmp_path,
        walk_rows(8),
        "0123456789 abc ",
        "gigpo",
        "trainer.algorithm.advantage_estimator=gigpo",
        "trainer.algorithm.gigpo.gamma=0.9",
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        "trainer.max_steps=3",
        "generator.n_samples_per_prompt=4",
        "generator.max_turns=6",
        "generator.sampling_params.max_generate_length=1",
        "generator.max_input_length=2048",
    )
    steps = [h for h in history if "train/step_groups" in h]
    assert len(steps) == 3
    # The four samples of a prompt all act from cell 0 first: a step group a prompt at least.
    assert all(h["train/step_groups"] >= 2 and h["train/grouped_turn_fraction"] > 0 for h in steps)
    assert any(h["train/turn_advantage_std"] > 0 and h["policy/grad_norm"] > 0 for h in steps)


def test_mixed_precision_reaches_the_worker_and_the_engine(digits_model_dir, monkeypatch):
    import clew.trainer.launch

    model_dir = digits_model_dir
    cfg = load_config(None, [f"trainer.policy.model.path={model_dir}", "trainer.device=cpu"])
    asked: list[tuple[str, bool]] = []

    def precision(device, name, lora):
        asked.append((name, lora))
        return "float32", True  # what CUDA gives for bf16-mixed without LoRA

    monkeypatch.setattr(clew.trainer.launch, "policy_precision", precision)
    group = clew.trainer.launch.build_worker_group(cfg, num_train_rows=8)
    assert asked == [("bf16-mixed", False)]  # trainer.bf16 defaults to true
    assert group.worker.autocast and group.engine.autocast
    assert {p.dtype for p in group.worker.model.parameters()} == {torch.float32}
    cfg = load_config(
        None,
        [f"trainer.policy.model.path={model_dir}", "trainer.device=cpu", "trainer.bf16=false"],
    )
    clew.trainer.launch.build_worker_group(cfg, num_train_rows=8)
    assert asked[-1] == ("32-true", False)


def test_an_allowed_token_of_several_tokens_fails_while_the_worker_group_is_built(
    digits_model_dir,
):
    import clew.trainer.launch

    cfg = load_config(
        None,
        [
            f"trainer.policy.model.path={digits_model_dir}",
            "trainer.device=cpu",
            "generator.eval_sampling_params.allowed_tokens=['1', '23 45']",
        ],
    )
    with pytest.raises(ClewError, match="'23 45' is .* tokens"):
        clew.trainer.launch.build_worker_group(cfg, num_train_rows=8)


class _DroppingGroup:
    """A worker group whose update number ``n`` (from 1) reports ``dropped[n - 1]`` of its
    two optimizer steps dropped for a non-finite gradient (0 past the list's end)."""

    world_size = 1

    def __init__(self, dropped: list[float]) -> None:
        self.dropped, self.updates = dropped, 0

    def generate(self, rows, settings, seed, progress=None):
        out = []
        for g, row in enumerate(rows):
            for s in range(settings.n_samples_per_prompt):
                t = Trajectory(row.env_id, {}, int(row.seed), g, s)
                t.reward = float(s == 0)
                out.append(t)
        return out

    def update(self, batch, settings):
        self.updates += 1
        n = self.updates - 1
        dropped = self.dropped[n] if n < len(self.dropped) else 0.0
        return {"policy/optimizer_steps": 2.0, "policy/skipped_steps": dropped}


class _Loggers:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict]] = []

    def log(self, metrics, step):
        self.records.append((step, dict(metrics)))


def _fit(tmp_path, group, *overrides: str, eval_rows=0, loggers=None) -> GRPOTrainer:
    """A run of 8 steps (unless ``overrides`` say otherwise) on a group without a model."""
    base = [
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=1",
        "generator.n_samples_per_prompt=2",
        "trainer.eval_before_train=false",
        "trainer.max_steps=8",
        "trainer.epochs=1",
    ]
    cfg = load_config(None, [*base, *overrides])
    rows = generate_rows("maze_2d/small", 32, "train")
    trainer = GRPOTrainer(cfg, group, rows, rows[:eval_rows], loggers or _Loggers(), tmp_path)
    trainer.fit()
    return trainer


def test_the_group_is_handed_a_training_batch_and_settings_mapped_from_the_config(tmp_path):
    class Recording(_DroppingGroup):
        def update(self, batch, settings):
            self.seen = (batch, settings)
            return super().update(batch, settings)

    group = Recording([])
    overrides = ("trainer.max_steps=1", "trainer.micro_train_batch_size_per_gpu=2")
    _fit(tmp_path, group, *overrides, "trainer.update_epochs_per_batch=3")
    batch, settings = group.seen
    assert isinstance(batch, TrainingBatch) and isinstance(settings, PPOSettings)
    assert len(batch) == 4 and batch.advantages.shape == (4,)  # 2 prompts x 2 samples
    # policy_mini_batch_size=1 prompt of 2 samples a step, counted over the whole group
    assert (settings.mini_batch_size, settings.micro_batch_size, settings.epochs) == (2, 2, 3)


def test_three_updates_in_a_row_with_every_step_dropped_stop_the_run_with_a_clear_error(tmp_path):
    # Steps 1-2 drop one of their two optimizer steps (not all): no stop. Steps 3-5 drop all.
    group = _DroppingGroup([1, 1, 2, 2, 2])
    with pytest.raises(ClewError, match=r"NaN or infinite .* training steps 3-5"):
        _fit(tmp_path, group)
    assert group.updates == 5


def test_a_good_update_between_dropped_ones_keeps_the_run_going(tmp_path):
    group = _DroppingGroup([2, 2, 0, 2, 2, 1, 2, 2])
    assert _fit(tmp_path, group).state.global_step == 8


@pytest.mark.parametrize(("max_steps", "evaluated"), [(7, [3, 6, 7]), (6, [3, 6])])
def test_a_run_ending_between_evaluations_evaluates_its_last_step_once(
    tmp_path, max_steps, evaluated
):
    loggers = _Loggers()
    overrides = ("trainer.eval_interval=3", f"trainer.max_steps={max_steps}")
    _fit(tmp_path, _DroppingGroup([]), *overrides, eval_rows=4, loggers=loggers)
    steps = [step for step, m in loggers.records if "eval/all/pass_at_1" in m]
    assert steps == evaluated
