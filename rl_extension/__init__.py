"""rl_extension: a PPO/GRPO trainer for language models, written on the spmdcall SDK.

Import what you need from its modules (`rl_extension.algorithms.core`, `rl_extension.data.prompts`,
`rl_extension.data.rewards`, `rl_extension.models`, ...); this package import itself loads nothing heavy.
It needs the packages of the ``rl`` extra (``pip install "spmdcall[rl]"``), and says so when one is missing.

Extension points register with one decorator each, and the config accepts any registered name:
``register_adv_estimator`` (``rl_extension.algorithms.advantages``, ``algorithm.adv_estimator``),
``register_policy_loss`` (``rl_extension.algorithms.policy_losses``, ``actor.policy_loss``), ``register_scorer``
(``rl_extension.data.scorers``, ``reward.scorer``) and ``register_tool_format`` (``rl_extension.agents.formats``,
``rollout.multi_turn.format``), each kept in a ``rl_extension.registry.Registry``. The config's ``imports``
lists your modules that register such names, so that the command line and YAML files can name them.
"""

import importlib.util

__version__ = "0.1.0"

# The import names of the packages the [rl] extra installs (pyproject.toml), spmdcall[torch]'s included.
REQUIRED_MODULES = (
    "torch",
    "tensordict",
    "transformers",
    "tokenizers",
    "pyarrow",
    "yaml",
    "tqdm",
    "tensorboard",
    "matplotlib",
)

_missing = [module for module in REQUIRED_MODULES if importlib.util.find_spec(module) is None]
if _missing:
    raise ModuleNotFoundError(
        f'rl_extension needs {", ".join(_missing)}, not installed here: pip install "spmdcall[rl]"',
        name=_missing[0],
    )
