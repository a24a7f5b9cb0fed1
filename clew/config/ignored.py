"""The SkyRL keys that clew accepts but ignores, and the one warning each earns.

SkyRL scripts set keys that have no meaning for clew's colocated workers, each sampling from
the weights it trains. They are accepted so the scripts run unchanged, and each one set to a
value that would matter under SkyRL is named in one warning per process, saying why
(``warn_ignored``, called by ``clew.config.validate.validate``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clew.config.keys import get_key
from clew.config.schema import ClewConfig


class IgnoredKeyWarning(UserWarning):
    """A SkyRL key was set that clew accepts but does not act on."""


@dataclass(frozen=True)
class IgnoredKey:
    """Why clew ignores a key, and when its value is worth a warning."""

    why: str
    applies: Callable[[ClewConfig, Any], bool]


def _not(default: Any) -> Callable[[ClewConfig, Any], bool]:
    return lambda cfg, value: value != default


_REF_WHY = (
    "the KL reference (the base model with the LoRA adapter off, or a frozen copy) lives on "
    "the policy's device"
)

# The registry: key -> why clew ignores it, and the values that earn a warning.
IGNORED_KEYS: dict[str, IgnoredKey] = {
    "trainer.policy.model.lora.lora_sync_path": IgnoredKey(
        "clew's engine runs in the trainer process and reads the adapter weights directly, "
        "so nothing is synced through a directory",
        _not(None),
    ),
    "trainer.policy.fsdp_config.cpu_offload": IgnoredKey(
        "clew keeps the policy's parameters on its device", _not(False)
    ),
    "trainer.ref.fsdp_config.cpu_offload": IgnoredKey(
        "clew keeps the reference model (used only with use_kl_loss) on the policy's device",
        _not(False),
    ),
    "trainer.placement.colocate_all": IgnoredKey(
        "clew always generates and trains in the same process on the same device", _not(True)
    ),
    "trainer.placement.ref_num_nodes": IgnoredKey(_REF_WHY, _not(1)),
    "trainer.placement.ref_num_gpus_per_node": IgnoredKey(_REF_WHY, _not(1)),
    "generator.inference_engine.num_engines": IgnoredKey(
        "clew runs one engine in each worker's process, sampling from that worker's own weights",
        _not(1),
    ),
    "generator.inference_engine.tensor_parallel_size": IgnoredKey(
        "clew's engine runs on one GPU; it does not split a model across GPUs",
        lambda cfg, v: v > 1,
    ),
    "generator.inference_engine.engine_init_kwargs": IgnoredKey(
        "clew reads only max_model_len from it; other engine options do not apply",
        lambda cfg, v: any(k != "max_model_len" for k in v),
    ),
    "generator.vision_language_generator": IgnoredKey(
        "clew's generator always handles images and text", _not(True)
    ),
    "generator.batched": IgnoredKey(
        "clew always steps all episodes of a batch together, turn by turn", _not(False)
    ),
}

_warned: set[str] = set()


def warn_ignored(cfg: ClewConfig) -> list[str]:
    """Warn once per process for each ignored key whose value would matter under SkyRL.

    Returns the keys warned about by this call.
    """
    warned = []
    for key, entry in IGNORED_KEYS.items():
        value = get_key(cfg, key)
        if key in _warned or not entry.applies(cfg, value):
            continue
        _warned.add(key)
        warned.append(key)
        warnings.warn(
            f"config key {key}={value!r} is accepted but ignored: {entry.why}",
            IgnoredKeyWarning,
            stacklevel=3,
        )
    return warned


def reset_ignored_warnings() -> None:
    """Forget which ignored keys were warned about (for tests)."""
    _warned.clear()
