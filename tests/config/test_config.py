"""Tests for clew.config: SkyRL-compatible overrides, typed errors, validation rules, saving."""

from __future__ import annotations

import re
import shlex
import warnings
from pathlib import Path

import pytest

from clew.config import (
    IGNORED_KEYS,
    ClewConfig,
    IgnoredKeyWarning,
    all_keys,
    apply_overrides,
    load_config,
    parse_value,
    save_config,
    schema_markdown,
    validate,
)
from clew.config.ignored import reset_ignored_warnings
from clew.config.keys import KEY_ALIASES, RETIRED_KEYS, RETIRED_VALUES, key_table
from clew.config.settings import engine_options
from clew.errors import ConfigError

# The seed's SkyRL train_job.sh arguments, as the shell hands them over (outer quotes removed,
# $VARS expanded to placeholder paths).
SEED_ARGS = [
    "data.train_data=['/data/maze/train.parquet']",
    "data.val_data=['/data/maze_eval/train.parquet']",
    "trainer.algorithm.advantage_estimator=grpo",
    "trainer.policy.model.path=/ckpts/sft",
    "trainer.policy.model.lora.rank=32",
    "trainer.policy.model.lora.alpha=32",
    "trainer.policy.model.lora.lora_sync_path=/shared/lora",
    "trainer.placement.colocate_all=true",
    "trainer.strategy=fsdp",
    "trainer.placement.policy_num_nodes=3",
    "trainer.placement.policy_num_gpus_per_node=2",
    "trainer.placement.ref_num_nodes=3",
    "trainer.placement.ref_num_gpus_per_node=2",
    "trainer.ref.fsdp_config.cpu_offload=false",
    "generator.inference_engine.num_engines=6",
    "generator.inference_engine.tensor_parallel_size=1",
    "generator.inference_engine.gpu_memory_utilization=0.45",
    "generator.inference_engine.engine_init_kwargs.max_model_len=16000",
    "environment.env_class=visgym",
    "trainer.epochs=20",
    "trainer.train_batch_size=24",
    "trainer.policy_mini_batch_size=12",
    "trainer.micro_forward_batch_size_per_gpu=1",
    "trainer.micro_train_batch_size_per_gpu=1",
    "trainer.update_epochs_per_batch=1",
    "trainer.max_prompt_length=2048",
    "generator.sampling_params.max_generate_length=1024",
    "generator.sampling_params.temperature=0.7",
    "generator.max_turns=15",
    "generator.max_input_length=8192",
    "generator.n_samples_per_prompt=8",
    "generator.vision_language_generator=true",
    "generator.batched=false",
    "trainer.remove_microbatch_padding=false",
    "trainer.algorithm.use_kl_loss=false",
    "trainer.policy.optimizer_config.lr=3.0e-6",
    "trainer.eval_interval=10",
    "trainer.eval_before_train=true",
    "trainer.ckpt_interval=20",
    "trainer.hf_save_interval=20",
    "trainer.logger=console",
    "trainer.project_name=vlm_maze_2d_easy",
    "trainer.run_name=sft_grpo_7",
    "trainer.resume_mode=latest",
    "trainer.log_path=/tmp/skyrl-logs",
    "trainer.dump_eval_results=true",
    "trainer.export_path=/exports/run7",
    "trainer.ckpt_path=s3://<your-bucket>/skyrl-visgym/ckpts/sft-grpo",
]

# The same command as written in train_job.sh, for a check through real shell quoting.
SEED_SHELL = """
data.train_data="['$TRAIN_DIR/train.parquet']" data.val_data="['$EVAL_DIR/train.parquet']"
trainer.algorithm.advantage_estimator="grpo" trainer.policy.model.path="$SFT_CKPT"
trainer.policy.model.lora.rank=32 trainer.policy.model.lora.alpha=32 trainer.policy.model.lora.lora_sync_path="/shared/lora"
trainer.placement.colocate_all=true trainer.strategy=fsdp trainer.placement.policy_num_nodes=3 trainer.placement.policy_num_gpus_per_node=2
trainer.placement.ref_num_nodes=3 trainer.placement.ref_num_gpus_per_node=2 trainer.ref.fsdp_config.cpu_offload=false
generator.inference_engine.num_engines=6 generator.inference_engine.tensor_parallel_size=1 generator.inference_engine.gpu_memory_utilization=0.45
generator.inference_engine.engine_init_kwargs.max_model_len=16000 environment.env_class=visgym
trainer.epochs=20 trainer.train_batch_size=24 trainer.policy_mini_batch_size=12 trainer.micro_forward_batch_size_per_gpu=1 trainer.micro_train_batch_size_per_gpu=1
trainer.update_epochs_per_batch=1 trainer.max_prompt_length=2048 generator.sampling_params.max_generate_length=1024 generator.sampling_params.temperature=0.7
generator.max_turns=15 generator.max_input_length=8192 generator.n_samples_per_prompt=8 generator.vision_language_generator=true generator.batched=false
trainer.remove_microbatch_padding=false trainer.algorithm.use_kl_loss=false trainer.policy.optimizer_config.lr=3.0e-6 trainer.eval_interval=10
trainer.eval_before_train=true trainer.ckpt_interval=20 trainer.hf_save_interval=20 trainer.logger="console" trainer.project_name="vlm_maze_2d_easy"
trainer.run_name="sft_grpo_${RUN_ID}" trainer.resume_mode=latest trainer.log_path="/tmp/skyrl-logs" trainer.dump_eval_results=true
trainer.export_path="$EXPORT_PATH" trainer.ckpt_path="s3://<your-bucket>/skyrl-visgym/ckpts/sft-grpo"
"""
SHELL_VARS = {
    "$TRAIN_DIR": "/data/maze",
    "$EVAL_DIR": "/data/maze_eval",
    "$SFT_CKPT": "/ckpts/sft",
    "${RUN_ID}": "7",
    "$EXPORT_PATH": "/exports/run7",
}


# The seed trains on 3 nodes x 2 GPUs; clew runs one worker, so the seed's command is
# loaded on one device.
ONE_DEVICE = [
    "trainer.placement.policy_num_nodes=1",
    "trainer.placement.policy_num_gpus_per_node=1",
    "trainer.placement.ref_num_nodes=1",
    "trainer.placement.ref_num_gpus_per_node=1",
]


def _load_quiet(overrides: list[str]) -> ClewConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredKeyWarning)
        return load_config(None, overrides)


def test_seed_skyrl_command_parses_to_typed_values() -> None:
    cfg = _load_quiet([*SEED_ARGS, *ONE_DEVICE])
    assert cfg.data.train_data == ["/data/maze/train.parquet"]
    assert cfg.data.val_data == ["/data/maze_eval/train.parquet"]
    tr, gen = cfg.trainer, cfg.generator
    assert tr.algorithm.advantage_estimator == "grpo"
    assert tr.policy.model.path == "/ckpts/sft"
    assert tr.policy.model.lora.rank == 32 and tr.policy.model.lora.alpha == 32.0
    assert tr.policy.model.lora.lora_sync_path == "/shared/lora"
    assert tr.placement.colocate_all is True and tr.placement.num_gpus == 1
    assert tr.ref.fsdp_config.cpu_offload is False
    assert gen.inference_engine.num_engines == 6
    assert gen.inference_engine.gpu_memory_utilization == 0.45
    assert gen.inference_engine.max_model_len == 16000
    assert cfg.environment.env_class == "maze_2d"  # the 'visgym' alias
    assert (tr.epochs, tr.train_batch_size, tr.policy_mini_batch_size) == (20, 24, 12)
    assert tr.max_prompt_length == 2048
    assert gen.sampling_params.max_generate_length == 1024
    assert gen.sampling_params.temperature == 0.7
    assert (gen.max_turns, gen.max_input_length, gen.n_samples_per_prompt) == (15, 8192, 8)
    assert gen.vision_language_generator is True and gen.batched is False
    assert tr.policy.optimizer_config.lr == 3.0e-6
    assert isinstance(tr.policy.optimizer_config.lr, float)
    assert (tr.eval_interval, tr.ckpt_interval, tr.hf_save_interval) == (10, 20, 20)
    assert tr.logger == "console" and tr.run_name == "sft_grpo_7"
    assert tr.resume_mode == "latest" and tr.dump_eval_results is True
    assert tr.ckpt_path == "s3://<your-bucket>/skyrl-visgym/ckpts/sft-grpo"
    # Evaluation stays greedy but generates as long as training does.
    assert gen.eval_sampling_params.temperature == 0.0
    assert gen.eval_sampling_params.max_generate_length == 1024


def test_seed_command_through_shell_quoting_gives_the_same_config() -> None:
    text = SEED_SHELL
    for var, value in SHELL_VARS.items():
        text = text.replace(var, value)
    assert _load_quiet([*shlex.split(text), *ONE_DEVICE]) == _load_quiet([*SEED_ARGS, *ONE_DEVICE])


def test_the_seeds_six_gpu_placement_is_accepted_as_six_workers() -> None:
    # Whether the cluster has the GPUs is checked at launch, not in the config.
    placement = _load_quiet(SEED_ARGS).trainer.placement
    assert placement.num_gpus == placement.num_workers == 6


def test_a_mini_batch_splits_over_any_number_of_cpu_workers() -> None:
    cfg = load_config(None, ["trainer.placement.num_cpu_workers=2"])
    assert cfg.trainer.placement.num_workers == 2
    # 3 trajectories over 2 workers: split by count, one worker takes two (docs/cluster.md)
    cfg = load_config(
        None,
        [
            "trainer.placement.num_cpu_workers=2",
            "trainer.policy_mini_batch_size=1",
            "generator.n_samples_per_prompt=3",
            "trainer.micro_train_batch_size_per_gpu=1",
            "trainer.train_batch_size=1",
        ],
    )
    assert cfg.trainer.placement.num_workers == 2


def test_unknown_key_errors_and_suggests_the_nearest_key() -> None:
    with pytest.raises(
        ConfigError, match=r"trainer\.polcy\.model\.path.*trainer\.policy\.model\.path"
    ):
        load_config(None, ["trainer.polcy.model.path=x"])
    with pytest.raises(ConfigError, match=r"trainer\.policy\.optimizer_config\.lr"):
        load_config(None, ["trainer.lr=1e-5"])


def test_a_misspelt_selection_key_suggests_data_select_data() -> None:
    with pytest.raises(ConfigError, match=r"'data\.selct_data'; did you mean 'data\.select_data'"):
        load_config(None, ["data.selct_data=['s.parquet']"])
    with pytest.raises(ConfigError, match=r"did you mean 'pipeline\.dataset\.select_rows'"):
        load_config(None, ["pipeline.dataset.select_row=8"])


def test_unknown_key_in_yaml_file_suggests_the_nearest_key(tmp_path: Path) -> None:
    path = tmp_path / "base.yaml"
    path.write_text("trainer:\n  polcy:\n    model:\n      path: x\n")
    with pytest.raises(ConfigError, match=r"did you mean 'trainer\.policy\.model\.path'"):
        load_config(path)


def test_a_removed_key_says_it_was_removed_and_what_clew_does_now(tmp_path: Path) -> None:
    md = schema_markdown()
    asked_for = {  # a value asking for what the key did and clew no longer does
        "generator.inference_engine.kv_cache": "dynamic",
        "generator.inference_engine.merged_projections": "true",
        "generator.inference_engine.packed_prefill": "false",
        "generator.inference_engine.dedup_images": "false",
        "trainer.hidden_image_attention": "blocks",
        "trainer.attention_query_block": "512",
    }
    assert set(asked_for) == set(RETIRED_KEYS)
    for key, (kept, why) in RETIRED_KEYS.items():
        assert key not in key_table() and f"| `{key}` |" in md
        with pytest.raises(
            ConfigError, match=re.escape(f"{key}' was removed from clew; what clew does now: {why}")
        ):
            load_config(None, [f"{key}={asked_for[key]}"])
        # Set to what clew does now, it is read with a warning that says the same.
        with pytest.warns(IgnoredKeyWarning, match=re.escape(f"{key}' was removed")):
            load_config(None, [f"{key}={'null' if kept is None else str(kept).lower()}"])
    # An old YAML asking for removed behaviour: all named in one error.
    path = tmp_path / "old.yaml"
    path.write_text(
        "generator:\n  inference_engine:\n    kv_cache: dynamic\n    dedup_images: false\n"
    )
    with pytest.raises(ConfigError, match=r"old\.yaml.*removed.*kv_cache.*dedup_images"):
        load_config(path)
    # An old run's saved config holds each at its old default: it loads, with a warning each.
    path.write_text(
        "generator:\n  inference_engine:\n    kv_cache: static\n    packed_prefill: true\n"
        "    dedup_images: true\n    merged_projections: false\n    enforce_eager: true\n"
        "trainer:\n  hidden_image_attention: dense\n  attention_query_block: null\n"
    )
    with pytest.warns(IgnoredKeyWarning) as seen:
        cfg = load_config(path)
    assert cfg.generator.inference_engine.enforce_eager is True
    assert len({str(w.message) for w in seen if "was removed from clew" in str(w.message)}) == 6
    # A removed value names what to set instead.
    for key, values in RETIRED_VALUES.items():
        for value, why in values.items():
            assert f"| `{key}: {value}` |" in md
            with pytest.raises(
                ConfigError, match=re.escape(f"{key}='{value}' was removed from clew: {why}")
            ):
                load_config(None, [f"{key}={value}"])


def test_wrong_type_errors_naming_key_value_and_type() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.epochs=abc"])
    assert "trainer.epochs" in str(err.value)
    assert "'abc'" in str(err.value) and "expected int" in str(err.value)
    with pytest.raises(ConfigError, match=r"trainer\.bf16: expected bool, got 3"):
        load_config(None, ["trainer.bf16=3"])
    with pytest.raises(ConfigError, match=r"trainer\.strategy: expected 'fsdp' \| 'ddp'"):
        load_config(None, ["trainer.strategy=megatron"])


def test_section_given_a_scalar_is_a_config_error_not_a_pydantic_one(tmp_path: Path) -> None:
    path = tmp_path / "base.yaml"
    path.write_text("trainer:\n  algorithm: 3\n")
    with pytest.raises(ConfigError, match=r"trainer\.algorithm: expected a mapping"):
        load_config(path)


@pytest.mark.parametrize(
    ("overrides", "rule"),
    [
        (["trainer.epochs=0"], "positive-count"),
        (["generator.max_turns=-1"], "positive-count"),
        (["trainer.eval_interval=0"], "interval"),
        (["trainer.max_ckpts_to_keep=0"], "max-ckpts"),
        (["trainer.policy.optimizer_config.lr=0.0"], "positive"),
        (["trainer.policy.optimizer_config.weight_decay=-0.1"], "non-negative"),
        (["trainer.policy.optimizer_config.adam_betas=[0.9]"], "adam-betas"),
        (["trainer.train_batch_size=12"], "batch-divisible"),
        (["trainer.micro_train_batch_size_per_gpu=65"], "micro-batch-size"),
        (["trainer.micro_train_batch_size_per_gpu=3"], "micro-batch-divisible"),
        (["generator.n_samples_per_prompt=1"], "group-size"),
        (["trainer.algorithm.advantage_estimator=grpoo"], "advantage-estimator"),
        (["generator.sampling_params.temperature=-0.5"], "temperature"),
        (["generator.sampling_params.top_p=0"], "top-p"),
        (["generator.eval_sampling_params.top_p=1.5"], "top-p"),
        (["generator.sampling_params.top_k=0"], "top-k"),
        (["generator.sampling_params.allowed_tokens=[]"], "allowed-tokens"),
        (["generator.inference_engine.gpu_memory_utilization=0"], "gpu-memory-utilization"),
        (["generator.inference_engine.gpu_memory_utilization=1.2"], "gpu-memory-utilization"),
        (["trainer.algorithm.eps_clip_low=1.0"], "eps-clip"),
        (["trainer.algorithm.eps_clip_high=0"], "eps-clip"),
        (["trainer.algorithm.clip_ratio_c=0.5"], "clip-ratio-c"),
        (["trainer.resume_mode=from_path"], "resume-path"),
        (
            ["trainer.algorithm.entropy_target=-0.1", "trainer.algorithm.use_entropy_loss=true"],
            "entropy-floor",
        ),
        (["trainer.algorithm.entropy_target=0.2"], "entropy-floor"),  # no use_entropy_loss
        (["trainer.algorithm.entropy_coef_step=0"], "entropy-floor"),
        (["trainer.algorithm.entropy_coef_max=-1"], "entropy-floor"),
        (
            [
                "trainer.algorithm.entropy_loss_coef=0.9",
                "trainer.algorithm.use_entropy_loss=true",
                "trainer.algorithm.entropy_target=0.2",
            ],
            "entropy-floor",
        ),
        (["generator.sampling_params.temperature_end=0"], "temperature-schedule"),
        (["generator.sampling_params.temperature_end=-1.5"], "temperature-schedule"),
        (
            [
                "generator.sampling_params.temperature=0",
                "generator.sampling_params.temperature_end=1",
            ],
            "temperature-schedule",
        ),
        (["generator.eval_sampling_params.temperature_end=0.5"], "temperature-schedule"),
        (["trainer.max_prompt_length=8192"], "context-fits-turn"),
        (["generator.inference_engine.engine_init_kwargs.max_model_len=4096"], "max-model-len"),
        (["trainer.logger=[console,nope]"], "logger"),
        (["generator.eval_n_samples_per_prompt=4"], "eval-samples-greedy"),
        (["trainer.placement.num_cpu_workers=0"], "positive-count"),
        (["trainer.placement.num_cpu_workers=2", "trainer.device=cuda"], "one-kind-of-worker"),
        (
            ["trainer.placement.num_cpu_workers=2", "trainer.placement.policy_num_nodes=2"],
            "one-kind-of-worker",
        ),
    ],
)
def test_each_validation_rule_rejects_a_bad_value(overrides: list[str], rule: str) -> None:
    value = overrides[0].split("=", 1)[1].strip("[]").split(",")[-1]
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert f"[{rule}]" in str(err.value)
    assert value in str(err.value)


def test_allowed_tokens_reach_the_rollouts_and_the_update_but_not_evaluation() -> None:
    from clew.config.settings import ppo_settings, rollout_settings

    cfg = load_config(None, ["generator.sampling_params.allowed_tokens=[up,down,left,right,stop]"])
    words = ("up", "down", "left", "right", "stop")
    assert rollout_settings(cfg, evaluation=False).sampling.allowed_tokens == words
    assert ppo_settings(cfg).allowed_tokens == words
    assert rollout_settings(cfg, evaluation=True).sampling.allowed_tokens == ()


def test_several_eval_samples_are_accepted_with_a_sampling_temperature() -> None:
    overrides = ["generator.eval_n_samples_per_prompt=4"]
    cfg = load_config(None, [*overrides, "generator.eval_sampling_params.temperature=1.0"])
    assert cfg.generator.eval_n_samples_per_prompt == 4


def test_group_size_error_explains_a_group_of_one() -> None:
    with pytest.raises(ConfigError, match="must be >= 2 for 'grpo'.*no reward spread"):
        load_config(None, ["generator.n_samples_per_prompt=1"])


def test_validation_reports_every_failed_rule_at_once() -> None:
    cfg = ClewConfig()
    cfg.trainer.epochs = 0
    cfg.generator.sampling_params.top_p = 2.0
    with pytest.raises(ConfigError, match=r"\[positive-count\].*\[top-p\]"):
        validate(cfg)


def test_defaults_are_valid() -> None:
    assert validate(ClewConfig()) == ClewConfig()


def test_ignored_keys_warn_exactly_once_per_process() -> None:
    reset_ignored_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(None, [*SEED_ARGS, *ONE_DEVICE])
        load_config(None, [*SEED_ARGS, *ONE_DEVICE])
    messages = [str(w.message) for w in caught if issubclass(w.category, IgnoredKeyWarning)]
    warned = sorted(
        k for k in IGNORED_KEYS if any(m.startswith(f"config key {k}=") for m in messages)
    )
    assert warned == [
        "generator.inference_engine.num_engines",
        "trainer.policy.model.lora.lora_sync_path",
    ]
    assert len(messages) == 2
    assert all("ignored" in m for m in messages)


def test_ignored_keys_left_at_harmless_values_do_not_warn() -> None:
    reset_ignored_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(None, ["trainer.strategy=fsdp", "generator.vision_language_generator=true"])
    assert not [w for w in caught if issubclass(w.category, IgnoredKeyWarning)]


def test_a_reference_placement_is_accepted_with_a_warning_that_it_shares_the_policys_device():
    reset_ignored_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(None, ["trainer.placement.ref_num_gpus_per_node=2"])
    assert cfg.trainer.placement.num_gpus == 1
    (message,) = [str(w.message) for w in caught if issubclass(w.category, IgnoredKeyWarning)]
    assert "ref_num_gpus_per_node=2" in message and "the policy's device" in message


def test_every_ignored_key_is_a_real_key() -> None:
    assert set(IGNORED_KEYS) <= set(all_keys())


def test_save_and_load_round_trip_is_exact(tmp_path: Path) -> None:
    cfg = _load_quiet(
        [
            *SEED_ARGS,
            *ONE_DEVICE,
            "trainer.run_name='1e5'",
            "trainer.project_name='null'",
            "generator.sampling_params.stop=['</answer>', 'a,b']",
            "environment.env_options={size: 5, walls: [1, 2], name: 'x y'}",
            "trainer.logger=[console,jsonl]",
            "trainer.policy.model.lora.target_modules=[q_proj,v_proj]",
            "generator.keep_last_k_images=2",
        ]
    )
    path = save_config(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredKeyWarning)
        assert load_config(path) == cfg
        assert load_config(tmp_path / "run") == cfg  # a run folder works too
    assert load_config(path).model_dump() == cfg.model_dump()


def test_yaml_base_then_overrides_apply_in_order(tmp_path: Path) -> None:
    path = tmp_path / "base.yaml"
    path.write_text("trainer:\n  epochs: 3\n  policy:\n    optimizer_config:\n      lr: 1e-5\n")
    cfg = load_config(path, ["trainer.epochs=4", "trainer.epochs=5"])
    assert cfg.trainer.epochs == 5
    assert cfg.trainer.policy.optimizer_config.lr == 1e-5  # YAML 1.1 would read a string


def test_values_parse_like_hydra() -> None:
    assert parse_value("3") == 3 and parse_value("-2") == -2
    assert parse_value("3.0e-6") == 3.0e-6 and parse_value("1e-5") == 1e-5
    assert parse_value("true") is True and parse_value("False") is False
    assert parse_value("null") is None
    assert parse_value("['/a/train.parquet']") == ["/a/train.parquet"]
    assert parse_value("[a,b]") == ["a", "b"]
    assert parse_value("[1, 2.5, 'x,y', [c]]") == [1, 2.5, "x,y", ["c"]]
    assert parse_value("[]") == []
    assert parse_value("{a: 1, b: s3://x}") == {"a": 1, "b": "s3://x"}
    assert parse_value("'quoted, string'") == "quoted, string"
    assert parse_value('"3"') == "3"
    assert parse_value("s3://bucket/path") == "s3://bucket/path"


def test_string_fields_keep_override_text_verbatim() -> None:
    cfg = load_config(None, ["trainer.run_name=123", "trainer.project_name='true'"])
    assert cfg.trainer.run_name == "123" and cfg.trainer.project_name == "true"
    assert load_config(None, ["trainer.resume_mode=null"]).trainer.resume_mode == "none"


def test_malformed_overrides_are_config_errors() -> None:
    for bad in ["trainer.epochs", "data.train_data=['/a'", "~trainer.epochs", "trainer=1"]:
        with pytest.raises(ConfigError):
            load_config(None, [bad])


def test_apply_overrides_returns_a_copy() -> None:
    base = {"trainer": {"epochs": 2}}
    out = apply_overrides(base, ["trainer.epochs=3", "+generator.max_turns=4"])
    assert base == {"trainer": {"epochs": 2}}
    assert out == {"trainer": {"epochs": 3}, "generator": {"max_turns": 4}}


def test_schema_markdown_lists_every_key_with_a_description() -> None:
    md = schema_markdown()
    for key in all_keys():
        assert f"| `{key}` |" in md
    assert "Accepted but ignored by clew" in md
    undocumented = [k for k, info in key_table().items() if not info.field.description]
    assert undocumented == []


def test_a_forced_reply_format_reaches_the_rollout_settings() -> None:
    from clew.config.settings import rollout_settings

    cfg = load_config(None, ["generator.reply_prefix=<action>", "generator.reply_suffix=</action>"])
    for evaluation in (False, True):
        s = rollout_settings(cfg, evaluation)
        assert (s.reply_prefix, s.reply_suffix) == ("<action>", "</action>")
    plain = rollout_settings(load_config(None, []), False)
    assert (plain.reply_prefix, plain.reply_suffix) == ("", "")


def test_schedule_length_ends_at_max_steps_when_the_run_does() -> None:
    from clew.config.settings import optimizer_steps

    base = ["trainer.train_batch_size=8", "trainer.policy_mini_batch_size=4", "trainer.epochs=2"]
    # 2048 rows / 8 prompts = 256 steps an epoch; two optimizer steps a batch.
    assert optimizer_steps(load_config(None, base), 2048) == 2 * 256 * 2
    capped = load_config(None, [*base, "trainer.max_steps=60"])
    assert optimizer_steps(capped, 2048) == 60 * 2


def test_the_temperature_schedule_ends_at_the_training_step_the_lr_schedule_does() -> None:
    from clew.config.settings import training_steps

    base = ["trainer.train_batch_size=8", "trainer.policy_mini_batch_size=4", "trainer.epochs=2"]
    assert training_steps(load_config(None, base), 2048) == 2 * 256
    assert training_steps(load_config(None, [*base, "trainer.max_steps=60"]), 2048) == 60
    assert training_steps(load_config(None, [*base, "trainer.max_steps=0"]), 2048) == 1


def test_the_entropy_floor_and_the_temperature_schedule_are_accepted_in_range() -> None:
    cfg = load_config(
        None,
        [
            "trainer.algorithm.use_entropy_loss=true",
            "trainer.algorithm.entropy_loss_coef=0.0",
            "trainer.algorithm.entropy_target=0.3",
            "generator.sampling_params.temperature=1.0",
            "generator.sampling_params.temperature_end=0.6",
        ],
    )
    assert cfg.trainer.algorithm.entropy_target == 0.3
    assert cfg.generator.sampling_params.temperature_end == 0.6
    assert cfg.generator.eval_sampling_params.temperature_end is None  # not inherited


def test_an_unknown_estimator_names_the_registered_ones_and_the_nearest() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.algorithm.advantage_estimator=rlo"])
    message = str(err.value)
    assert "'gigpo', 'grpo', 'pass_at_k', 'rloo'" in message and "did you mean 'rloo'?" in message
    assert "clew.algorithms.register_estimator" in message


def test_skyrl_grpo_norm_by_std_is_an_alias_in_overrides_and_yaml(tmp_path: Path) -> None:
    off = load_config(None, ["trainer.algorithm.grpo_norm_by_std=false"])
    assert off.trainer.algorithm.norm_adv_by_std_in_grpo is False
    path = tmp_path / "base.yaml"
    path.write_text("trainer:\n  algorithm:\n    grpo_norm_by_std: false\n")
    assert load_config(path) == off
    # An override of either spelling replaces what the file gave.
    on = load_config(path, ["trainer.algorithm.norm_adv_by_std_in_grpo=true"])
    assert on.trainer.algorithm.norm_adv_by_std_in_grpo is True
    same = [
        "trainer.algorithm.grpo_norm_by_std=false",
        "trainer.algorithm.norm_adv_by_std_in_grpo=false",
    ]
    assert load_config(None, same) == off
    saved = save_config(off, tmp_path / "run").read_text()
    assert "norm_adv_by_std_in_grpo: false" in saved and "grpo_norm_by_std" not in saved


def test_an_alias_and_its_key_set_to_different_values_is_an_error(tmp_path: Path) -> None:
    both = [
        "trainer.algorithm.norm_adv_by_std_in_grpo=true",
        "trainer.algorithm.grpo_norm_by_std=false",
    ]
    with pytest.raises(ConfigError, match=r"grpo_norm_by_std=False.*disagree.*alias"):
        load_config(None, both)
    path = tmp_path / "base.yaml"
    path.write_text(
        "trainer:\n  algorithm:\n    grpo_norm_by_std: false\n    norm_adv_by_std_in_grpo: true\n"
    )
    with pytest.raises(ConfigError, match=r"disagree.*trainer\.algorithm\.norm_adv_by_std_in_grpo"):
        load_config(path)


def test_every_alias_stands_for_a_real_key_and_is_listed_in_the_docs() -> None:
    md = schema_markdown()
    for alias, key in KEY_ALIASES.items():
        assert key in key_table() and alias not in key_table()
        assert f"| `{alias}` | `{key}` |" in md
    assert "| `environment.env_class: visgym` | `environment.env_class: maze_2d` |" in md


def test_a_gpu_memory_fraction_holds_the_kv_caches_share_under_it() -> None:
    assert engine_options(load_config(None, [])).gpu_memory_utilization == 0.45
    capped = load_config(None, ["trainer.gpu_memory_fraction=0.2"])
    assert engine_options(capped).gpu_memory_utilization == 0.2


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.25"])
def test_a_gpu_memory_fraction_outside_zero_to_one_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"in \(0, 1\].*got"):
        load_config(None, [f"trainer.gpu_memory_fraction={bad}"])


def test_a_gpu_memory_fraction_is_refused_beside_workers_placed_on_ray() -> None:
    with pytest.raises(ConfigError, match="GPU of its own"):
        load_config(
            None, ["trainer.gpu_memory_fraction=0.5", "trainer.placement.num_cpu_workers=2"]
        )
