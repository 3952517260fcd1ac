"""rl_extension: a PPO/GRPO trainer for language models, written on the spmdcall SDK.

Import what you need from its modules (`rl_extension.algorithms`, `rl_extension.data`,
`rl_extension.rewards`, `rl_extension.models`, ...); this package import itself loads nothing heavy.
"""

__version__ = "0.1.0"
