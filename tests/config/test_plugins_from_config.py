"""A module named in ``environment.modules`` may register a policy loss, a KL estimator and a
logger, and the config names them (``clew train`` loads the config before anything else
imports the module); a name nobody registered fails naming the registered ones."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.tiny import digits_data

from clew.algorithms import KL_ESTIMATORS, POLICY_LOSSES
from clew.config import load_config
from clew.config.settings import ppo_settings
from clew.envs import plugins
from clew.errors import ConfigError, EnvError
from clew.metrics.loggers import LOGGERS
from clew.trainer.launch import run_grpo

MODULE = "clew_test_plugin"
SOURCE = """
from clew.algorithms import ppo_clip_loss, register_kl_estimator, register_policy_loss
from clew.metrics import register_logger

CALLS = {"loss": 0, "kl": 0, "logged": []}


@register_policy_loss("plugin_clip")
def plugin_clip(*args, **kwargs):
    CALLS["loss"] += 1
    return ppo_clip_loss(*args, **kwargs)


@register_kl_estimator("plugin_kl")
def plugin_kl(log_ratio):
    CALLS["kl"] += 1
    return log_ratio.square()


@register_logger("plugin_log")
class PluginLogger:
    def __init__(self, ctx):
        self.ctx = ctx

    def log(self, metrics, step):
        CALLS["logged"].append(step)

    def close(self):
        pass
"""
NAMES = [
    f"environment.modules=[{MODULE}]",
    "trainer.algorithm.policy_loss_type=plugin_clip",
    "trainer.algorithm.kl_estimator_type=plugin_kl",
    "trainer.logger=[console,plugin_log]",
]


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch) -> Iterator[Path]:
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield tmp_path
    finally:
        POLICY_LOSSES.pop("plugin_clip", None)
        KL_ESTIMATORS.pop("plugin_kl", None)
        LOGGERS.pop("plugin_log", None)
        plugins._loaded.discard(MODULE)
        sys.modules.pop(MODULE, None)


def test_a_config_names_what_its_modules_register(plugin_dir):
    cfg = load_config(None, NAMES)
    settings = ppo_settings(cfg)
    assert (settings.policy_loss, settings.kl_estimator) == ("plugin_clip", "plugin_kl")
    # SkyRL's name for the PPO clipped objective is still the default.
    assert ppo_settings(load_config(None, [])).policy_loss == "ppo_clip"


@pytest.mark.parametrize(
    "override, says",
    [
        ("trainer.algorithm.policy_loss_type=ppo_clp", "[policy-loss].*did you mean 'ppo_clip'"),
        ("trainer.algorithm.kl_estimator_type=k4", "[KL-estimator].*'k1', 'k2', 'k3'"),
        ("trainer.logger=[consol]", "[logger].*did you mean 'console'"),
        ("trainer.algorithm.policy_loss_type=plugin_clip", "register_policy_loss in a module"),
    ],
)
def test_a_name_nobody_registered_fails_with_the_registered_and_the_nearest(override, says):
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [override])


def test_a_module_that_does_not_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EnvError, match="broken_plugin.*ModuleNotFoundError"):
        load_config(None, ["environment.modules=[broken_plugin]"])
    sys.modules.pop("broken_plugin", None)


def test_the_registered_loss_kl_and_logger_run_in_training(plugin_dir, digits_model_dir):
    cfg = load_config(
        None,
        [
            *NAMES,
            "trainer.algorithm.use_kl_loss=true",
            f"data.train_data=['{digits_data(2)}']",
            f"trainer.policy.model.path={digits_model_dir}",
            f"trainer.log_path={plugin_dir / 'runs'}",
            "trainer.eval_before_train=false",
            "trainer.ckpt_interval=-1",
            "trainer.max_prompt_length=128",
            "trainer.train_batch_size=2",
            "trainer.policy_mini_batch_size=2",
            "trainer.max_steps=1",
            "generator.n_samples_per_prompt=2",
            "generator.max_turns=1",
            "generator.sampling_params.max_generate_length=4",
            "generator.max_input_length=512",
        ],
    )
    run_grpo(cfg)
    calls = sys.modules[MODULE].CALLS
    assert calls["loss"] >= 1 and calls["kl"] >= 1
    assert calls["logged"] == [1]
