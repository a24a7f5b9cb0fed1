"""Dotted keys over the config schema: listing, lookup, suggestions and the Markdown reference.

Overrides, unknown-key errors and the docs all speak in dotted keys
(``trainer.policy.optimizer_config.lr``). This module derives them from the pydantic models
in ``schema.py`` so that the key list, the types and the descriptions have one source.
"""

from __future__ import annotations

import difflib
import json
import types
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from clew.config.schema import ENV_CLASS_ALIASES, ClewConfig

# Other spellings of keys (SkyRL's older names): alias -> the key it stands for. Either may
# be set, in a YAML file or an override; both set to different values is an error.
KEY_ALIASES: dict[str, str] = {
    "trainer.algorithm.grpo_norm_by_std": "trainer.algorithm.norm_adv_by_std_in_grpo",
}

# Other spellings of values, by key: alias value -> the value stored.
VALUE_ALIASES: dict[str, dict[str, str]] = {"environment.env_class": ENV_CLASS_ALIASES}

# Keys clew removed (docs/speed.md, "Removed switches"): key -> (the value that asks for
# what clew does now, what clew does now). Set to that value (an old run's saved config.yaml
# holds each at its old default), the key is dropped with a warning; set to another, the
# config fails with that line instead of "unknown key", so an old config says what changed.
RETIRED_KEYS: dict[str, tuple[Any, str]] = {
    "generator.inference_engine.kv_cache": (
        "static",
        "the in-place slot cache is the only KV cache "
        "(transformers' DynamicCache, 'dynamic', was measured slower)",
    ),
    "generator.inference_engine.merged_projections": (
        False,
        "each layer's projections stay separate "
        "products (merged ones were measured no faster in a decode step or a rollout)",
    ),
    "generator.inference_engine.packed_prefill": (
        True,
        "a GPU prefill with prefill_attention "
        "triton or varlen always runs the rows' new tokens packed (measured faster than padded)",
    ),
    "generator.inference_engine.dedup_images": (
        True,
        "the engine always runs each distinct image "
        "of a forward through the vision tower once (measured faster than every copy)",
    ),
    "trainer.hidden_image_attention": (
        "dense",
        "the update attends under the dense visibility "
        "mask (attention by observation chunk, 'blocks', was measured slower)",
    ),
    "trainer.attention_query_block": (
        None,
        "the update attends under the dense visibility mask in one call a layer, or "
        "with trainer.flex_attention through FlexAttention, which skips the blocks no query "
        "sees (query blocks were measured slower than FlexAttention)",
    ),
}

# Values clew removed, by key: value -> what to set instead.
RETIRED_VALUES: dict[str, dict[str, str]] = {
    "generator.inference_engine.decode_attention": {
        "flex": "FlexAttention decode steps were measured slower than 'sdpa'; set 'auto'",
        "flash": "FlashAttention's decoding path was measured no faster than 'varlen'; "
        "set 'auto' or 'varlen'",
    },
}


@dataclass(frozen=True)
class KeyInfo:
    """One dotted key: a leaf field, or a section (a nested model)."""

    key: str
    field: FieldInfo
    is_section: bool
    is_open_dict: bool  # a dict field: keys below it are free-form


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _walk(model: type[BaseModel], prefix: str) -> Iterator[KeyInfo]:
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if _is_model(ann):
            yield KeyInfo(key, field, is_section=True, is_open_dict=False)
            yield from _walk(ann, key + ".")
        else:
            is_dict = ann is dict or get_origin(ann) is dict
            yield KeyInfo(key, field, is_section=False, is_open_dict=is_dict)


@cache
def key_table() -> dict[str, KeyInfo]:
    """Every section and leaf of ``ClewConfig``, by dotted key, in declaration order."""
    return {info.key: info for info in _walk(ClewConfig, "")}


def all_keys() -> list[str]:
    """Every leaf key an override or a YAML file may set, in declaration order."""
    return [k for k, info in key_table().items() if not info.is_section]


def canonical_key(key: str) -> str:
    """``key`` with an alias (the whole key, or a section above it) spelt as the key it
    stands for; any other key unchanged."""
    for alias, target in KEY_ALIASES.items():
        if key == alias or key.startswith(alias + "."):
            return target + key[len(alias) :]
    return key


def lookup(key: str) -> KeyInfo | None:
    """The schema entry that governs ``key``: itself, or the dict field it lies inside."""
    table = key_table()
    if key in table:
        return table[key]
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        info = table.get(".".join(parts[:i]))
        if info is not None:
            return info if info.is_open_dict else None
    return None


def suggest(key: str) -> list[str]:
    """Known keys nearest an unknown ``key``: same last name first, then difflib's best."""
    keys = all_keys()

    def ratio(k: str) -> float:
        return difflib.SequenceMatcher(None, key, k).ratio()

    last = key.rsplit(".", 1)[-1]
    same_name = sorted((k for k in keys if k.rsplit(".", 1)[-1] == last), key=ratio, reverse=True)
    near = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    if near:
        best = ratio(near[0])
        near = [k for k in near if ratio(k) >= best - 0.05]
    return list(dict.fromkeys(same_name + near))[:3]


def retired_keys_message(keys: list[str]) -> str:
    """The error text for keys of ``RETIRED_KEYS`` set to what clew no longer does."""
    where = '(docs/speed.md, "Removed switches")'
    if len(keys) == 1:
        key = keys[0]
        return (
            f"config key {key!r} was removed from clew; what clew does now: "
            f"{RETIRED_KEYS[key][1]}. Delete it from the config {where}"
        )
    lines = "; ".join(f"{key!r} (now: {RETIRED_KEYS[key][1]})" for key in keys)
    return f"config keys removed from clew: {lines}. Delete them from the config {where}"


def retired_key_kept(key: str, value: Any) -> bool:
    """True when ``key`` was removed and ``value`` asks for what clew does now anyway: the
    key is then dropped with a warning (``retired_key_warning``) rather than refused."""
    return key in RETIRED_KEYS and value == RETIRED_KEYS[key][0]


def retired_key_warning(key: str) -> str:
    return (
        f"config key {key!r} was removed from clew and is ignored: {RETIRED_KEYS[key][1]}. "
        "Delete it from the config"
    )


def retired_value_message(key: str, value: Any) -> str | None:
    """The error text for a removed value of ``key`` (``RETIRED_VALUES``), None for others."""
    why = RETIRED_VALUES.get(key, {}).get(value) if isinstance(value, str) else None
    return None if why is None else f"{key}={value!r} was removed from clew: {why}"


def unknown_key_message(key: str) -> str:
    """The error text for an unknown key, with the nearest known keys (or, for a removed
    key, what clew does now)."""
    if key in RETIRED_KEYS:
        return retired_keys_message([key])
    near = suggest(key)
    hint = f"; did you mean {' or '.join(repr(k) for k in near)}?" if near else ""
    return f"unknown config key {key!r}{hint}"


def type_name(annotation: Any) -> str:
    """A short, user-facing spelling of a field type: ``int``, ``str | None``, ``'k1' | 'k3'``."""
    origin = get_origin(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(annotation))
    if origin in (list, dict):
        args = ", ".join(type_name(a) for a in get_args(annotation))
        return f"{origin.__name__}[{args}]" if args else origin.__name__
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def accepts_only_strings(annotation: Any) -> bool:
    """True when a field takes a string (or a string literal, or null) and nothing else.

    Overrides for such fields keep their text verbatim (``run_name=123`` is the string "123").
    """
    origin = get_origin(annotation)
    if annotation is str:
        return True
    if origin is Literal:
        return all(isinstance(a, str) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return bool(args) and all(accepts_only_strings(a) for a in args)
    return False


def get_key(obj: Any, key: str) -> Any:
    """The value at dotted ``key`` of a config object."""
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def schema_markdown(ignored: dict[str, str] | None = None) -> str:
    """The whole schema as Markdown: one table (key, type, default, description) per section.

    ``ignored`` maps keys clew accepts but ignores to the reason, appended to their description.
    """
    defaults = ClewConfig()
    ignored = ignored or {}
    out = ["# clew configuration", ""]
    sections = [("", ClewConfig.__doc__ or "")]
    sections += [(k, i.field.description or "") for k, i in key_table().items() if i.is_section]
    for section, about in sections:
        rows = [
            info
            for k, info in key_table().items()
            if not info.is_section and k.rsplit(".", 1)[0] == section and "." in k
        ]
        if not rows:
            continue
        out += [f"## `{section}`", "", " ".join(about.split()), ""]
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        for info in rows:
            default = json.dumps(get_key(defaults, info.key), default=str)
            desc = info.field.description or ""
            if info.key in ignored:
                desc += f" *Accepted but ignored by clew: {ignored[info.key]}*"
            out.append(
                f"| `{info.key}` | `{_cell(type_name(info.field.annotation))}` "
                f"| `{_cell(default)}` | {_cell(desc)} |"
            )
        out.append("")
    return "\n".join(out + aliases_markdown() + retired_markdown())


def aliases_markdown() -> list[str]:
    """The "Aliases" section: every key alias and value alias, and what each stands for."""
    out = [
        "## Aliases",
        "",
        "Other spellings clew accepts, in YAML files and overrides alike (SkyRL's names). "
        "Setting a key and its alias to different values is an error.",
        "",
        "| alias | stands for |",
        "|---|---|",
    ]
    out += [f"| `{alias}` | `{key}` |" for alias, key in KEY_ALIASES.items()]
    for key, values in VALUE_ALIASES.items():
        out += [f"| `{key}: {alias}` | `{key}: {value}` |" for alias, value in values.items()]
    return [*out, ""]


def retired_markdown() -> list[str]:
    """The "Removed keys" section: every retired key and value, and what clew does now."""
    out = [
        "## Removed keys",
        "",
        "Keys and values clew no longer has. A config that still sets a key to what clew "
        "does now (an old run's saved config) is read with a warning; any other setting fails "
        'with the line below. [speed.md](speed.md), "Removed switches", has what each measured.',
        "",
        "| key | what clew does now |",
        "|---|---|",
    ]
    out += [f"| `{key}` | {_cell(why)} |" for key, (_, why) in RETIRED_KEYS.items()]
    for key, values in RETIRED_VALUES.items():
        out += [f"| `{key}: {value}` | {_cell(why)} |" for value, why in values.items()]
    return [*out, ""]
