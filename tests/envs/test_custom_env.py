"""An environment registered outside clew, with its expert, trains like the maze: its rows,
SFT on its expert's demonstrations (with detours, starts anywhere, a DAgger round and the
agreement evaluation), then GRPO from the SFT policy."""

from __future__ import annotations

import json

import pytest
from envs_for_tests import LineEnv, LineExpert
from support.tiny import tiny_policy

from clew.config import load_config
from clew.data.rows import generate_rows, read_rows, write_rows
from clew.envs import expert_for
from clew.metrics import read_history
from clew.trainer.launch import run_grpo
from clew.trainer.sft_launch import run_sft_stage

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_registered_env_with_its_expert_trains_with_sft_and_grpo(tmp_path):
    assert isinstance(expert_for("test/line"), LineExpert)
    train = generate_rows("test/line", 8)
    evals = generate_rows("test/line", 4, "eval")
    # No dataset hooks: every seed of the split's range, and the expert's facts.
    assert [r.seed for r in train] == list(range(8)) and min(r.seed for r in evals) > 8
    assert train[0].facts() == {"turns_needed": 3, "solvable": True}
    write_rows(train, tmp_path / "train.parquet")
    write_rows(evals, tmp_path / "eval.parquet")
    assert read_rows(tmp_path / "train.parquet") == train

    corpus = "Reach cell 3: answer right or left. at cell 0 1 2 3 4 unreadable "
    model_dir = tiny_policy(corpus=[corpus * 20], image_size=28)
    common = [
        f"data.train_data=['{tmp_path / 'train.parquet'}']",
        f"data.val_data=['{tmp_path / 'eval.parquet'}']",
        f"trainer.log_path={tmp_path / 'runs'}",
        "trainer.logger=jsonl",
    ]
    sft = run_sft_stage(
        load_config(
            None,
            [
                *common,
                f"sft.model_path={model_dir}",
                "sft.steps=24",
                "sft.batch_size=4",
                "sft.optimizer_config.lr=3e-3",
                "sft.optimizer_config.num_warmup_steps=0",
                "sft.detour_prob=0.2",
                "sft.start_anywhere=0.5",
                "sft.dagger.interval=12",
                "sft.dagger.rows=4",
            ],
        )  # fmt: skip
    )
    logged = {r["step"]: r for r in read_history(sft.run_dir)}
    losses = [logged[s]["sft/loss"] for s in sorted(logged)]
    assert len(losses) == 24 and sum(losses[-4:]) / 4 < 0.5 * losses[0], losses
    assert "sft/dagger_solve_rate" in logged[13]
    # The expert's replies were learnt: the greedy policy walks right to cell 3.
    assert sft.last_eval["eval/all/pass_at_1"] == 1.0, sft.last_eval
    assert sft.last_eval["eval/agreement/all"] == 1.0
    assert sft.last_eval["eval/agreement/far"] == 1.0  # the expert's own groups

    history = _grpo(tmp_path, sft.final_policy, common)
    steps = [h for h in history if "train/reward_mean" in h]
    assert len(steps) == 2 and all(h["train/reward_mean"] > 0.5 for h in steps), steps


def _grpo(tmp_path, policy: str, common: list[str]) -> list[dict]:
    cfg = load_config(
        None,
        [
            *common,
            f"trainer.policy.model.path={policy}",
            "trainer.run_name=grpo",
            "trainer.eval_before_train=false",
            "trainer.eval_interval=-1",
            "trainer.ckpt_interval=-1",
            "trainer.max_prompt_length=128",
            "trainer.train_batch_size=2",
            "trainer.policy_mini_batch_size=2",
            "trainer.max_steps=2",
            "generator.n_samples_per_prompt=4",
            f"generator.max_turns={LineEnv.max_turns}",
            "generator.sampling_params.max_generate_length=4",
            "generator.max_input_length=2048",
        ],
    )
    run_grpo(cfg)
    lines = (tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
