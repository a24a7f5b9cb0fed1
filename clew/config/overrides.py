"""Dotted ``key=value`` overrides, parsed the way Hydra/OmegaConf parses them.

Why Hydra's grammar: SkyRL launch scripts (``trainer.policy.optimizer_config.lr=3.0e-6
data.train_data="['/d/train.parquet']"``) must run unchanged under clew. Values parse as
null, bools, ints, floats, ``[lists]``, ``{dicts}`` or strings; a field that only takes strings
keeps the text verbatim (``trainer.run_name=123`` is the string "123"). Unknown keys fail here,
with the nearest known keys suggested, and pydantic's errors are turned into ``ConfigError``s
that name the dotted key, the value and the expected type.

Aliases (``keys.KEY_ALIASES``, e.g. SkyRL's older ``trainer.algorithm.grpo_norm_by_std``) are
spelt as their keys before anything else: in a YAML mapping, and in each override. Within one
source (a file, or the list of overrides) setting an alias and its key to different values is
an error; an override of either replaces what the file gave either, as overrides do.
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

from pydantic import ValidationError

from clew.config.ignored import IgnoredKeyWarning
from clew.config.keys import (
    KEY_ALIASES,
    RETIRED_KEYS,
    accepts_only_strings,
    canonical_key,
    key_table,
    lookup,
    retired_key_kept,
    retired_key_warning,
    retired_keys_message,
    retired_value_message,
    type_name,
)
from clew.config.keys import unknown_key_message as _unknown
from clew.config.schema import ClewConfig
from clew.errors import ConfigError

_INT = re.compile(r"[+-]?\d+(_\d+)*")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?|[+-]?(inf|nan)", re.IGNORECASE)
_QUOTES = ("'", '"')


def _is_quoted(text: str) -> bool:
    return len(text) >= 2 and text[0] in _QUOTES and text[-1] == text[0]


def _unquote(text: str) -> str:
    q = text[0]
    return text[1:-1].replace("\\" + q, q)


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside quotes and brackets."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = ""
        elif ch in _QUOTES:
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced {ch!r}")
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if quote or depth:
        raise ValueError("unterminated quote or bracket")
    parts.append(text[start:])
    return parts


def parse_value(text: str) -> Any:
    """Parse one override value: null, bool, int, float, [list], {dict}, 'quoted' or bare string.

    Raises ``ValueError`` on unbalanced quotes or brackets.
    """
    t = text.strip()
    if t[:1] in _QUOTES:
        if not _is_quoted(t):
            raise ValueError("unterminated quote")
        return _unquote(t)
    if t[:1] in "[{":
        closer = "]" if t[0] == "[" else "}"
        if not t.endswith(closer):
            raise ValueError(f"{t[0]!r} without a closing {closer!r}")
        items = [p for p in _split_top(t[1:-1], ",") if p.strip()]
        if t[0] == "[":
            return [parse_value(p) for p in items]
        out: dict[str, Any] = {}
        for item in items:
            pair = _split_top(item, ":")
            if len(pair) < 2:
                raise ValueError(f"dict item {item.strip()!r} is not key: value")
            k = pair[0].strip()
            out[_unquote(k) if _is_quoted(k) else k] = parse_value(":".join(pair[1:]))
        return out
    low = t.lower()
    if low == "null":
        return None
    if low in ("true", "false"):
        return low == "true"
    if _INT.fullmatch(t):
        return int(t.replace("_", ""))
    if _FLOAT.fullmatch(t):
        return float(t)
    return t


def _string_value(text: str) -> str | None:
    t = text.strip()
    if _is_quoted(t):
        return _unquote(t)
    return None if t.lower() == "null" else t


def _set(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


_MISSING = object()


def _pop(data: dict[str, Any], key: str) -> Any:
    """Remove and return the value at dotted ``key`` of nested ``data``, or ``_MISSING``."""
    *sections, last = key.split(".")
    node: Any = data
    for part in sections:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or last not in node:
        return _MISSING
    return node.pop(last)


def resolve_aliases(data: dict[str, Any]) -> dict[str, Any]:
    """Move the value of each alias in nested ``data`` (in place) to the key it stands for.

    Raises ``ConfigError`` when an alias and its key are both set, to different values.
    """
    for alias, key in KEY_ALIASES.items():
        value = _pop(data, alias)
        if value is _MISSING:
            continue
        current = _value_at(data, key, _MISSING)
        if current is not _MISSING and current != value:
            raise ConfigError(_conflict(alias, value, key, current, key))
        _set(data, key, value)
    return data


def _conflict(first: str, first_value: Any, second: str, second_value: Any, key: str) -> str:
    return (
        f"{first}={first_value!r} and {second}={second_value!r} disagree, and one is an "
        f"alias of the other (both set {key}); set only one of them"
    )


def apply_overrides(cfg_dict: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``cfg_dict`` with each ``key=value`` override applied, in order.

    A leading ``+`` or ``++`` (Hydra's "add key") is accepted and ignored. Aliases in
    ``cfg_dict`` and in the overrides are spelt as their keys (see the module docstring).
    """
    data = resolve_aliases(copy.deepcopy(cfg_dict))
    spelt: dict[str, tuple[str, Any]] = {}  # key -> (spelling, value) of its last override
    for override in overrides:
        raw_key, sep, text = override.partition("=")
        written = raw_key.strip().lstrip("+")
        if not sep or not written:
            raise ConfigError(f"override {override!r} is not of the form key=value")
        if written.startswith("~"):
            raise ConfigError(f"override {override!r}: deleting keys (~key) is not supported")
        key = canonical_key(written)
        info = lookup(key)
        if info is None and key in RETIRED_KEYS:
            try:
                kept = retired_key_kept(key, parse_value(text))
            except ValueError:
                kept = False
            if not kept:
                raise ConfigError(retired_keys_message([key]))
            warnings.warn(retired_key_warning(key), IgnoredKeyWarning, stacklevel=2)
            continue
        if info is None:
            raise ConfigError(_unknown(key))
        if info.is_section:
            raise ConfigError(
                f"override {override!r}: {key!r} is a section; set one of its keys "
                f"(e.g. {key}.<name>=...)"
            )
        try:
            if info.key == key and accepts_only_strings(info.field.annotation):
                value = _string_value(text)
            else:
                value = parse_value(text)
        except ValueError as exc:
            raise ConfigError(f"override {override!r}: cannot parse value: {exc}") from None
        before, before_value = spelt.get(key, (written, value))
        if before != written and before_value != value:
            raise ConfigError(_conflict(before, before_value, written, value, key))
        spelt[key] = (written, value)
        _set(data, key, value)
    return data


def _first_leaf(key: str, value: Any) -> str:
    """For an unknown key whose value is a mapping, the first full key beneath it."""
    while isinstance(value, dict) and value:
        name, value = next(iter(value.items()))
        key = f"{key}.{name}"
    return key


def drop_retired_keys(data: dict[str, Any]) -> None:
    """Remove from nested ``data`` the removed keys (``RETIRED_KEYS``) set to what clew does
    now, with a warning each; raise ``ConfigError`` naming every other one in one error (an
    old run's saved config holds every one)."""
    refused = []
    for key in RETIRED_KEYS:
        value = _value_at(data, key, _MISSING)
        if value is _MISSING:
            continue
        if retired_key_kept(key, value):
            section, _, name = key.rpartition(".")
            del _value_at(data, section, {})[name]
            warnings.warn(retired_key_warning(key), IgnoredKeyWarning, stacklevel=3)
        else:
            refused.append(key)
    if refused:
        raise ConfigError(retired_keys_message(refused))


def check_keys(data: dict[str, Any], prefix: str = "") -> None:
    """Raise ``ConfigError`` for the first key in nested ``data`` that the schema lacks;
    removed keys first (``drop_retired_keys``, which also drops those it accepts)."""
    if not prefix:
        drop_retired_keys(data)
    for name, value in data.items():
        key = f"{prefix}{name}"
        info = lookup(key)
        if info is None:
            raise ConfigError(_unknown(_first_leaf(key, value)))
        if info.is_section and isinstance(value, dict):
            check_keys(value, key + ".")


def _value_at(data: Any, key: str, fallback: Any) -> Any:
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return fallback
        data = data[part]
    return data


def build_config(data: dict[str, Any]) -> ClewConfig:
    """Validate nested ``data`` into a ``ClewConfig``; every failure is a ``ConfigError``."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    data = resolve_aliases(copy.deepcopy(data))
    check_keys(data)
    try:
        return ClewConfig.model_validate(data)
    except ValidationError as exc:
        raise _config_error(exc, data) from None


def _config_error(exc: ValidationError, data: dict[str, Any]) -> ConfigError:
    table, lines, seen = key_table(), [], set()
    for err in exc.errors(include_url=False):
        parts: list[str] = []
        key = ""
        for part in err["loc"]:
            if not isinstance(part, str):
                break
            parts.append(part)
            if ".".join(parts) in table:
                key = ".".join(parts)
        key = key or ".".join(str(p) for p in err["loc"]) or "<root>"
        if key in seen:
            continue
        seen.add(key)
        info = table.get(key)
        expected = type_name(info.field.annotation) if info else "?"
        if info is not None and info.is_section:
            expected = "a mapping of keys"
        value = _value_at(data, key, err.get("input"))
        retired = retired_value_message(key, value)
        if retired is not None:
            lines.append(retired)
            continue
        lines.append(f"{key}: expected {expected}, got {value!r} ({err['msg']})")
    return ConfigError("invalid config value: " + "; ".join(lines))
