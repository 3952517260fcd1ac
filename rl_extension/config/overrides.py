"""``key=value`` overrides and YAML mappings applied onto a config, each value parsed to its field's type.

A dotted key reaches into sections (``rollout.temperature=0.7``). A value from the command line is
a string: ``true``/``false`` for bools, ``[a, b]`` or ``a,b`` for lists, ``{k: v}`` for mappings,
``null`` for optional fields. An unknown key raises ValueError naming it and the closest valid keys.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, TypeVar

import yaml

from rl_extension.config.schema import config_keys, field_types

__all__ = ["apply_dict", "apply_overrides"]

C = TypeVar("C")


def apply_overrides(config: C, overrides: list[str] | tuple[str, ...]) -> C:
    """Return a copy of ``config`` with ``key=value`` strings applied (values parsed to each field's type).

    Example:
        >>> apply_overrides(PPOConfig(), ["actor.lr=1e-5", "trainer.loggers=[jsonl]"]).actor.lr
        1e-05
    """
    config = copy.deepcopy(config)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like section.key=value")
        _set(config, key, raw.strip(), source="command line")
    return config


def apply_dict(config: C, values: dict, *, source: str = "a mapping", prefix: str = "") -> C:
    """Return a copy of ``config`` with a nested mapping (a parsed YAML file) applied."""
    config = copy.deepcopy(config)
    _apply_nested(config, values, source, prefix, type(config))
    return config


def _apply_nested(section: Any, values: dict, source: str, prefix: str, root: type) -> None:
    if not isinstance(values, dict):
        raise ValueError(
            f"{prefix.rstrip('.') or 'the config'} (from {source}) must be a mapping, got {values!r}"
        )
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        types_ = field_types(type(section))
        if key not in types_:
            raise _unknown_key(dotted, root, source)
        if dataclasses.is_dataclass(types_[key]):
            _apply_nested(getattr(section, key), value, source, f"{dotted}.", root)
        else:
            setattr(section, key, _coerce(value, types_[key], dotted))


def _set(config: Any, dotted: str, raw: str, source: str) -> None:
    *sections, name = dotted.split(".")
    target = config
    for section in sections:
        types_ = field_types(type(target))
        if section not in types_ or not dataclasses.is_dataclass(types_[section]):
            raise _unknown_key(dotted, type(config), source)
        target = getattr(target, section)
    types_ = field_types(type(target))
    if name not in types_:
        raise _unknown_key(dotted, type(config), source)
    if dataclasses.is_dataclass(types_[name]):
        value = yaml.safe_load(raw) if raw else None
        if not isinstance(value, dict):
            raise ValueError(
                f"{dotted} is a section; set its keys ({dotted}.<key>=...) or give a mapping {{k: v}}"
            )
        _apply_nested(getattr(target, name), value, source, f"{dotted}.", type(config))
        return
    setattr(target, name, _coerce(raw, types_[name], dotted))


def _unknown_key(dotted: str, root: type, source: str) -> ValueError:
    keys = config_keys(root)
    close = difflib.get_close_matches(dotted, keys, n=3, cutoff=0.75)
    leaf = dotted.rsplit(".", 1)[-1]
    close += [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k not in close][:3]
    hint = f"; did you mean {' or '.join(repr(k) for k in close)}?" if close else ""
    section = dotted.rsplit(".", 1)[0] if "." in dotted else ""
    in_section = [k for k in keys if section and k.startswith(section + ".")]
    listing = f" Keys of {section!r}: {', '.join(in_section)}." if in_section and not close else ""
    return ValueError(f"unknown config key {dotted!r} (from {source}){hint}{listing}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` (a YAML value, or a raw string from the command line) as type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            if type(None) in args:
                return None
        return _coerce(value, non_none[0], key)
    if origin is Literal:
        # choices are strings (or numbers): compare on the parsed value
        for choice in args:
            if value == choice or (isinstance(value, str) and str(choice) == value.strip()):
                return choice
        raise ValueError(f"{key} must be one of {list(args)}, got {value!r}")
    if origin is list or tp is list:
        return _to_list(value, args[0] if args else Any, key)
    if origin is dict or tp is dict:
        return _to_dict(value, key)
    if tp not in _SCALARS:
        raise TypeError(f"{key}: unsupported config field type {tp!r}")  # a bug in this module
    return _SCALARS[tp](value, key)


def _to_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    lowered = value.strip().lower() if isinstance(value, str) else None
    if lowered in ("true", "yes", "on", "1"):
        return True
    if lowered in ("false", "no", "off", "0"):
        return False
    raise ValueError(f"{key} expects true or false, got {value!r}")


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{key} expects an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    try:
        return int(str(value).strip().replace("_", ""))
    except ValueError:
        raise ValueError(f"{key} expects an integer, got {value!r}") from None


def _to_float(value: Any, key: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{key} expects a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} expects a number, got {value!r}") from None


def _to_str(value: Any, key: str) -> str:
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        raise ValueError(f"{key} expects a string, got {value!r}")
    return value if isinstance(value, str) else str(value)


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _to_list(value: Any, item_tp: Any, key: str) -> list:
    if isinstance(value, str):
        text = value.strip()
        value = (
            yaml.safe_load(text)
            if text.startswith("[")
            else [p.strip() for p in text.split(",") if p.strip()]
        )
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key} expects a list, got {value!r}")
    return [v if item_tp is Any else _coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]


def _to_dict(value: Any, key: str) -> dict:
    if isinstance(value, str):
        value = yaml.safe_load(value) if value.strip() else {}
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{key} expects a mapping like {{a: 1}}, got {value!r}")
    return dict(value)
