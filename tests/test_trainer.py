"""End to end on the tiny model: the GRPO loop raises the training reward."""

from __future__ import annotations

import json

import torch
from envs_for_tests import digits_rows

from clew.config import load_config
from clew.data.rows import write_rows
from clew.models import build_model
from clew.run import train


def test_grpo_raises_the_training_reward(tmp_path):
    model_dir = tmp_path / "tiny"
    build_model("tiny", model_dir, corpus=["0123456789 " * 20], image_size=28, overwrite=True)
    write_rows(digits_rows(64), tmp_path / "train.parquet")
    cfg = load_config(
        None,
        [
            f"data.train_data=['{tmp_path / 'train.parquet'}']",
            f"trainer.policy.model.path={model_dir}",
            f"trainer.log_path={tmp_path / 'runs'}",
            "trainer.run_name=digits",
            "trainer.logger=jsonl",
            "trainer.train_batch_size=4",
            "trainer.policy_mini_batch_size=4",
            "trainer.micro_train_batch_size_per_gpu=32",
            "trainer.epochs=4",
            "trainer.eval_before_train=false",
            "trainer.ckpt_interval=-1",
            "trainer.policy.optimizer_config.lr=3.0e-3",
            "trainer.policy.optimizer_config.weight_decay=0.0",
            "generator.n_samples_per_prompt=8",
            "generator.max_turns=1",
            "generator.sampling_params.max_generate_length=6",
            "generator.max_input_length=512",
            "trainer.max_prompt_length=128",
        ],
    )
    train(cfg)
    history = [
        json.loads(line)
        for line in (tmp_path / "runs" / "digits" / "metrics.jsonl").read_text().splitlines()
    ]
    rewards = [h["train/reward_mean"] for h in history if "train/reward_mean" in h]
    assert len(rewards) == 64
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.2, f"reward went from {first:.3f} to {last:.3f}"
    assert (tmp_path / "runs" / "digits" / "config.yaml").is_file()
    assert (tmp_path / "runs" / "digits" / "exports" / "global_step_64" / "policy").is_dir()


def test_mixed_precision_reaches_the_worker_and_the_engine(tmp_path, monkeypatch):
    import clew.run

    model_dir = tmp_path / "tiny"
    build_model("tiny", model_dir, corpus=["0123456789 " * 20], image_size=28, overwrite=True)
    cfg = load_config(None, [f"trainer.policy.model.path={model_dir}", "trainer.device=cpu"])
    asked: list[tuple[str, bool]] = []

    def precision(device, name, lora):
        asked.append((name, lora))
        return "float32", True  # what CUDA gives for bf16-mixed without LoRA

    monkeypatch.setattr(clew.run, "policy_precision", precision)
    group = clew.run.build_worker_group(cfg, num_train_rows=8)
    assert asked == [("bf16-mixed", False)]  # trainer.bf16 defaults to true
    assert group.worker.autocast and group.engine.autocast
    assert {p.dtype for p in group.worker.model.parameters()} == {torch.float32}
    cfg = load_config(
        None,
        [f"trainer.policy.model.path={model_dir}", "trainer.device=cpu", "trainer.bf16=false"],
    )
    clew.run.build_worker_group(cfg, num_train_rows=8)
    assert asked[-1] == ("32-true", False)
