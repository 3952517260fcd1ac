"""rl_extension: a PPO/GRPO trainer for language models, written on the spmdcall SDK.

Import what you need from its modules (`rl_extension.algorithms`, `rl_extension.data`,
`rl_extension.rewards`, `rl_extension.models`, ...); this package import itself loads nothing heavy.
It needs the packages of the ``rl`` extra (``pip install "spmdcall[rl]"``), and says so when one is missing.
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
