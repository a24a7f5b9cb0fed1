"""Tests for recipes/: every recipe loads as a config, and says what its header says."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.tiny import TINY_GRPO

from clew.config import load_config
from clew.envs import make
from clew.errors import ConfigError
from clew.trainer.pipeline import check_stages, frame_side

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_the_three_recipes_are_there() -> None:
    names = {p.name for p in RECIPES.glob("*.yaml")}
    assert {"cpu-demo.yaml", "easy-1gpu.yaml", "seed-qwen3vl-8b.yaml"} <= names


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_loads_and_its_model_sees_the_whole_frame(recipe: Path) -> None:
    cfg = load_config(recipe)
    d, m = cfg.pipeline.dataset, cfg.pipeline.model
    if "model" in cfg.pipeline.stages:
        assert m.image_size in (None, frame_side(d.env_id, dict(d.env_options)))
    # The seed's run spans its 6 GPUs (3 nodes x 2); the others run on one device.
    want = 6 if recipe.name == "seed-qwen3vl-8b.yaml" else 1
    assert cfg.trainer.placement.num_gpus == want


def test_a_key_typo_in_a_recipe_fails_naming_the_key(tmp_path: Path) -> None:
    text = (RECIPES / "cpu-demo.yaml").read_text().replace("max_steps:", "max_step:")
    bad = tmp_path / "typo.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match="max_step"):
        load_config(bad)


def test_the_cpu_demo_recipe_is_the_main_job() -> None:
    cfg = load_config(RECIPES / "cpu-demo.yaml")
    d, m, s, t, g = cfg.pipeline.dataset, cfg.pipeline.model, cfg.sft, cfg.trainer, cfg.generator
    assert (d.env_id, d.train_rows, d.eval_rows) == ("maze_2d/room", 2048, 64)
    assert d.env_options == {"cell_px": 14, "action_format": "keyword"}
    assert (m.preset, m.arch, m.image_size, m.patch_size, m.merge_size) == (
        "tiny",
        "qwen3_vl",
        98,
        14,
        1,
    )
    assert (s.steps, s.batch_size, s.seed) == (150, 16, 0)
    assert (s.optimizer_config.lr, s.optimizer_config.num_warmup_steps) == (1e-3, 10)
    assert (t.max_steps, t.train_batch_size, t.policy_mini_batch_size) == (60, 8, 4)
    assert (g.n_samples_per_prompt, g.max_turns, g.keep_last_k_images) == (8, 12, 1)
    assert g.max_turns == make(d.env_id, **d.env_options).max_turns
    assert (t.eval_interval, t.ckpt_interval, t.hf_save_interval) == (15, 60, 60)
    assert t.policy.optimizer_config.scheduler == "cosine"
    assert g.sampling_params.temperature == 0.7
    assert g.eval_sampling_params.temperature == 0.0
    check_stages(cfg)


def test_the_seed_recipe_maps_the_walkthroughs_run() -> None:
    cfg = load_config(RECIPES / "seed-qwen3vl-8b.yaml")
    t, g = cfg.trainer, cfg.generator
    assert (t.policy.model.lora.rank, t.policy.model.lora.alpha) == (32, 32.0)
    assert (t.train_batch_size, t.policy_mini_batch_size, g.n_samples_per_prompt) == (24, 12, 8)
    assert (g.max_turns, t.eval_interval, t.ckpt_interval, t.hf_save_interval) == (15, 10, 20, 20)
    assert t.resume_mode == "latest" and cfg.environment.env_class == "maze_2d"
    assert "sft" not in cfg.pipeline.stages
    # The start is the user's: a chain without it is refused before any work.
    with pytest.raises(ConfigError, match="trainer.policy.model.path"):
        check_stages(cfg)
    check_stages(load_config(RECIPES / "seed-qwen3vl-8b.yaml", ["trainer.policy.model.path=/m"]))


def test_the_easy_recipe_chains_sft_and_grpo_from_scratch() -> None:
    cfg = load_config(RECIPES / "easy-1gpu.yaml")
    assert cfg.pipeline.stages == ["dataset", "model", "sft", "train", "test"]
    assert cfg.pipeline.dataset.env_id == "maze_2d/easy"
    assert cfg.pipeline.test.rows == 1024
    check_stages(cfg)


def test_the_easy_recipe_runs_its_whole_chain_on_the_cpu_made_tiny(tmp_path, one_thread) -> None:
    """Every stage with the recipe's own settings (DAgger rounds, the current frame only,
    the forced action format, the selection set, the best policy kept, the test stage), at
    a size that runs in seconds, before any device time goes to the full run."""
    import json

    from clew.cli import main

    out = tmp_path / "easy"
    tiny = [
        "pipeline.model.preset=tiny",
        "pipeline.dataset.train_rows=64",
        "pipeline.dataset.eval_rows=4",
        "pipeline.dataset.select_rows=4",
        "pipeline.test.rows=4",
        "sft.steps=2",
        "sft.batch_size=4",
        "sft.micro_batch_size=4",
        "sft.eval_interval=1",
        "sft.dagger.interval=1",
        "sft.dagger.rows=4",
        "sft.optimizer_config.num_warmup_steps=1",
        *TINY_GRPO,
        "trainer.eval_interval=1",
        "trainer.ckpt_interval=1",
        "trainer.hf_save_interval=1",
        "trainer.device=cpu",
        "trainer.flex_attention=false",  # FlexAttention trains on CUDA alone
        "generator.max_turns=6",
    ]
    args = ["pipeline", "--config", str(RECIPES / "easy-1gpu.yaml"), "--output-dir", str(out)]
    assert main([*args, *tiny]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_rows"] == 4
    for key in ("sft_pass_at_1", "final_pass_at_1", "best_select_pass_at_1"):
        assert 0.0 <= summary[key] <= 1.0
    assert (out / "sft" / "exports" / "final" / "policy").is_dir()
    assert (out / "grpo" / "exports" / "best" / "policy").is_dir()
    saved = load_config(out / "grpo" / "config.yaml")
    assert saved.generator.keep_last_k_images == 1
    assert saved.generator.sampling_params.allowed_tokens == ["up", "down", "left", "right", "stop"]
    assert saved.trainer.algorithm.advantage_estimator == "gigpo"
    # Run again, the same command goes on where it stopped: every stage is skipped.
    assert main([*args, *tiny]) == 0
    assert json.loads((out / "summary.json").read_text()) == summary
