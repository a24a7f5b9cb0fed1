"""An advantage estimator registered outside clew trains through ``clew.trainer.launch.run_grpo``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.tiny import digits_data, digits_policy

from clew.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageResult,
    EstimatorBatch,
    EstimatorSettings,
    grpo_advantages,
    register_estimator,
    setting,
)
from clew.config import load_config
from clew.config.settings import rollout_settings
from clew.errors import ConfigError
from clew.trainer.launch import run_grpo

STEPS, PROMPTS, SAMPLES = 2, 2, 4
CALLS: list[tuple[EstimatorBatch, EstimatorSettings]] = []


def flipped(batch: EstimatorBatch, settings: EstimatorSettings) -> AdvantageResult:
    """GRPO's advantages with the sign flipped (reward digits less), recording each call."""
    CALLS.append((batch, settings))
    norm = setting(settings, "norm_adv_by_std_in_grpo", True)
    result = grpo_advantages(batch.rewards, batch.group_ids, norm_adv_by_std_in_grpo=norm)
    return AdvantageResult(
        advantages=-result.advantages,
        keep=result.keep,
        num_groups=result.num_groups,
        zero_spread_groups=result.zero_spread_groups,
    )


def zero(batch: EstimatorBatch, settings: EstimatorSettings) -> AdvantageResult:
    """Advantage 0 for every trajectory: the policy gradient vanishes."""
    CALLS.append((batch, settings))
    n = batch.rewards.shape[0]
    return AdvantageResult(torch.zeros(n), torch.ones(n, dtype=torch.bool), PROMPTS, 0)


@pytest.fixture
def estimators() -> Iterator[None]:
    register_estimator("test_flipped", needs={"turn_rewards"}, min_group_size=2)(flipped)
    register_estimator("test_zero")(zero)
    register_estimator("test_states", needs={"state_keys"})(zero)
    CALLS.clear()
    try:
        yield
    finally:
        for name in ("test_flipped", "test_zero", "test_states"):
            ADVANTAGE_ESTIMATORS.pop(name)


def _train(tmp_path: Path, estimator: str) -> tuple[dict, dict]:
    """Weights of the tiny model before and after a few GRPO steps with ``estimator``."""
    model_dir = digits_policy()
    cfg = load_config(
        None,
        [
            f"trainer.algorithm.advantage_estimator={estimator}",
            "trainer.algorithm.norm_adv_by_std_in_grpo=false",
            f"data.train_data=['{digits_data(STEPS * PROMPTS)}']",
            f"trainer.policy.model.path={model_dir}",
            f"trainer.log_path={tmp_path / 'runs'}",
            f"trainer.run_name={estimator}",
            "trainer.logger=jsonl",
            "trainer.eval_before_train=false",
            "trainer.ckpt_interval=-1",
            "trainer.max_prompt_length=128",
            f"trainer.train_batch_size={PROMPTS}",
            f"trainer.policy_mini_batch_size={PROMPTS}",
            "trainer.micro_train_batch_size_per_gpu=8",
            f"trainer.max_steps={STEPS}",
            "trainer.policy.optimizer_config.lr=1.0e-2",
            "trainer.policy.optimizer_config.weight_decay=0.0",
            f"generator.n_samples_per_prompt={SAMPLES}",
            "generator.max_turns=1",
            "generator.sampling_params.max_generate_length=4",
            "generator.max_input_length=512",
        ],
    )
    run_grpo(cfg)
    export = tmp_path / "runs" / estimator / "exports" / f"global_step_{STEPS}" / "policy"
    return load_file(model_dir / "model.safetensors"), load_file(export / "model.safetensors")


def test_a_registered_estimator_gets_the_rollouts_and_drives_the_update(tmp_path, estimators):
    before, after = _train(tmp_path, "test_flipped")
    assert len(CALLS) == STEPS
    for batch, settings in CALLS:
        assert batch.rewards.shape == (PROMPTS * SAMPLES,)
        assert sorted(torch.bincount(torch.as_tensor(batch.group_ids)).tolist()) == [4, 4]
        # It asked for turn rewards (one turn each here) and not for state keys.
        assert [len(r) for r in batch.turn_rewards] == [1] * PROMPTS * SAMPLES
        assert batch.state_keys is None
        assert settings["norm_adv_by_std_in_grpo"] is False
    assert any(not torch.equal(before[k], after[k]) for k in before)

    CALLS.clear()
    before, after = _train(tmp_path, "test_zero")
    assert len(CALLS) == STEPS and CALLS[0][0].turn_rewards is None
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_config_checks_a_registered_estimator_against_its_spec(estimators):
    for name, states in (("test_flipped", False), ("test_states", True), ("gigpo", True)):
        cfg = load_config(None, [f"trainer.algorithm.advantage_estimator={name}"])
        assert rollout_settings(cfg, evaluation=False).state_keys is states
        assert rollout_settings(cfg, evaluation=True).state_keys is False
    one = ["generator.n_samples_per_prompt=1", "generator.eval_n_samples_per_prompt=1"]
    load_config(None, ["trainer.algorithm.advantage_estimator=test_zero", *one])
    with pytest.raises(ConfigError, match=r"\[group-size\].*'test_flipped'"):
        load_config(None, ["trainer.algorithm.advantage_estimator=test_flipped", *one])
