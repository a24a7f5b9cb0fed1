"""clew's typed, validated configuration.

Why one typed tree: every component reads its settings from here, so a typo or an impossible
combination fails in ``load_config`` before any model is loaded, and the resolved tree is
saved with every run (``save_config``) so a run can be reproduced or resumed exactly. Key
names follow SkyRL where the two share a concept; see ``schema.py`` for every field.

Typical use::

    cfg = load_config("base.yaml", ["trainer.epochs=3", "data.train_data=['/d/train.parquet']"])
    save_config(cfg, run_dir)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from clew.config.ignored import IGNORED_KEYS, IgnoredKeyWarning
from clew.config.keys import all_keys
from clew.config.keys import schema_markdown as _schema_markdown
from clew.config.overrides import apply_overrides, build_config, drop_retired_keys, parse_value
from clew.config.schema import ClewConfig
from clew.config.validate import validate
from clew.errors import ConfigError

__all__ = [
    "IGNORED_KEYS",
    "ClewConfig",
    "IgnoredKeyWarning",
    "all_keys",
    "apply_overrides",
    "config_yaml",
    "load_config",
    "parse_value",
    "save_config",
    "schema_markdown",
    "validate",
]

CONFIG_FILE = "config.yaml"


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-6`` as a string; read it as the float everyone means."""


class _Dumper(yaml.SafeDumper):
    """Quotes strings such as "1e5" that ``_Loader`` would otherwise read back as floats."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:\d[\d_]*)(?:\.[\d_]*)?[eE][-+]?\d+$"),
        list("-+0123456789"),
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        path = path / CONFIG_FILE
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)  # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML: {where}{problem}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    return data


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> ClewConfig:
    """Build the run's config: defaults, then the YAML file (if any), then each override.

    ``path`` may be a YAML file or a run folder holding ``config.yaml``. The result is
    validated (``validate``); every problem raises ``ConfigError``.
    """
    data = _read_yaml(Path(path)) if path is not None else {}
    if path is not None:
        try:  # the file's own keys and types, so that an error can name the file
            drop_retired_keys(data)  # once, so each warns once
            build_config(data)
        except ConfigError as exc:
            raise ConfigError(f"config file {str(path)!r}: {exc}") from None
    return validate(build_config(apply_overrides(data, list(overrides))))


def config_yaml(cfg: ClewConfig) -> str:
    """The resolved ``cfg`` as the YAML a run saves (``load_config`` reads it back)."""
    text = yaml.dump(
        cfg.model_dump(mode="python"), Dumper=_Dumper, sort_keys=False, allow_unicode=True
    )
    return "# clew resolved configuration\n" + text


def save_config(cfg: ClewConfig, run_dir: str | Path) -> Path:
    """Write the resolved ``cfg`` to ``run_dir/config.yaml``; ``load_config`` reads it back."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    path.write_text(config_yaml(cfg))
    return path


def schema_markdown() -> str:
    """The configuration reference as Markdown: key, type, default and description per key."""
    return _schema_markdown({key: entry.why for key, entry in IGNORED_KEYS.items()})
