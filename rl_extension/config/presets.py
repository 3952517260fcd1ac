"""Presets and saved configs: a config is built from the dataclass defaults, a YAML preset, then overrides.

A preset (``rl_extension/presets/<name>.yaml``, or any YAML file, a run's saved ``config.yaml``
too) only overrides some defaults; ``base: other-preset`` starts it from another preset.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

import yaml

from rl_extension.config.overrides import apply_dict, apply_overrides

__all__ = ["PRESET_DIR", "load_config", "preset_names", "save_config", "split_preset", "to_dict", "to_yaml"]

PRESET_DIR = Path(__file__).parents[1] / "presets"

C = TypeVar("C")


def preset_names() -> list[str]:
    """Names of the presets shipped in rl_extension/presets."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def split_preset(items: list[str]) -> tuple[str | None, list[str]]:
    """The command line's items split into the ``preset=`` value (None without one) and the ``key=value`` overrides.

    Raises:
        ValueError: an item that is neither.

    Example:
        >>> split_preset(["preset=tiny-cpu", "rollout.n=4"])
        ('tiny-cpu', ['rollout.n=4'])
    """
    preset, overrides = None, []
    for item in items:
        if item.startswith("preset="):
            preset = item.partition("=")[2]
        elif "=" not in item:
            raise ValueError(f"expected key=value, got {item!r} (see spmdcall-rl config --keys)")
        else:
            overrides.append(item)
    return preset, overrides


def load_config(cls: type[C], preset: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> C:
    """Build a config: the dataclass defaults, then a preset, then ``key=value`` overrides.

    Args:
        cls: the config dataclass (PPOConfig or SFTConfig).
        preset: a preset name (see preset_names()) or a path to a YAML file; None for defaults.
        overrides: ``"section.key=value"`` strings, applied in order.

    Example:
        >>> config = load_config(PPOConfig, "tiny-cpu", ["rollout.n=4"])
        >>> config.rollout.n
        4
    """
    config = cls()
    if preset:
        config = apply_dict(config, _read_preset(preset), source=f"preset {preset!r}")
    config = apply_overrides(config, overrides)
    config.validate()
    return config


def _read_preset(preset: str, seen: tuple[str, ...] = ()) -> dict:
    path = Path(preset)
    if path.suffix not in (".yaml", ".yml"):
        path = PRESET_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise ValueError(f"no preset {preset!r}: not a YAML file and not one of {preset_names()}")
    if str(path) in seen:
        raise ValueError(f"preset {preset!r} includes itself via 'base' ({' -> '.join(seen)})")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"preset {path} must hold a mapping of sections, got {type(data).__name__}")
    # ``base: other-preset`` starts from another preset, so presets differ only where they must.
    base = data.pop("base", None)
    if base is None:
        return data
    return _merge(_read_preset(str(base), seen + (str(path),)), data)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def to_dict(config: Any) -> dict:
    """The config as nested plain dicts (YAML/JSON ready)."""
    return dataclasses.asdict(config)


def to_yaml(config: Any) -> str:
    """The config as YAML, sections in declaration order."""
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=None, width=120)


def save_config(config: Any, path: str | Path) -> str:
    """Write the config as YAML; ``load_config(type(config), preset=path)`` reads it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(config))
    return str(path)
