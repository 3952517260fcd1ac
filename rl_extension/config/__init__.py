"""Typed configs for the trainer: one dataclass per component, YAML presets, ``key=value`` overrides.

The dataclasses are the one source of truth: every key, its type, its default and its
documentation (the string under each field). A preset (``rl_extension/presets/<name>.yaml``, or
any YAML file) only overrides some defaults; command-line ``key=value`` pairs override on top.

    config = load_config(PPOConfig, preset="tiny-cpu", overrides=["actor.lr=3e-5", "trainer.total_steps=50"])
    print(to_yaml(config))

Dotted keys reach into sections (``rollout.temperature=0.7``); values are parsed to the field's
type (``true``/``false`` for bools, ``[a, b]`` or ``a,b`` for lists, ``null`` for optional fields);
an unknown key raises ``ValueError`` naming it and the closest valid keys. A numeric field declares
its valid range in its type (``lr: NonNegativeFloat``, see ``ranges``), and every section checks
itself (``Section.check``): ``validate()`` names the key of any value outside its range or at odds
with the others.

Where things are:

- ``schema``: the ``Section`` base (``check``), ``config_keys``, ``field_docs``;
- ``ranges``: ``Range`` and the range aliases (``PositiveInt``, ``Fraction``, ...);
- one module per section: ``model``, ``data``, ``roles`` (actor, rollout, ref, critic, reward),
  ``algorithm``, ``trainer``; the roots ``ppo`` (``PPOConfig``) and ``sft`` (``SFTConfig``);
- ``overrides``: ``key=value`` strings and YAML mappings, parsed to each field's type;
- ``optimizer``: ``OptimizerConfig``, the AdamW and schedule keys that actor, critic and SFT inherit;
- ``presets``: ``load_config``, the shipped presets, saving a config as YAML, ``split_preset``.

The reference page docs/rl/config.md is generated from the dataclasses by scripts/config_reference.py.
"""

from rl_extension.config.algorithm import AlgorithmConfig, KLControlConfig
from rl_extension.config.data import DataConfig, SyntheticDataConfig
from rl_extension.config.model import MIN_HEAD_DIM, ModelConfig, TinyModelConfig
from rl_extension.config.multi_turn import MultiTurnConfig
from rl_extension.config.optimizer import OptimizerConfig
from rl_extension.config.overrides import apply_dict, apply_overrides
from rl_extension.config.ppo import PPOConfig
from rl_extension.config.presets import (
    PRESET_DIR,
    load_config,
    preset_names,
    save_config,
    split_preset,
    to_dict,
    to_yaml,
)
from rl_extension.config.ranges import Range
from rl_extension.config.roles import ActorConfig, CriticConfig, RefConfig, RewardConfig, RolloutConfig
from rl_extension.config.schema import Section, config_keys, field_docs
from rl_extension.config.sft import SFTConfig
from rl_extension.config.trainer import TrainerConfig

__all__ = [
    "MIN_HEAD_DIM",
    "PRESET_DIR",
    "ActorConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DataConfig",
    "KLControlConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimizerConfig",
    "PPOConfig",
    "Range",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "Section",
    "SyntheticDataConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "apply_dict",
    "apply_overrides",
    "config_keys",
    "field_docs",
    "load_config",
    "preset_names",
    "save_config",
    "split_preset",
    "to_dict",
    "to_yaml",
]
