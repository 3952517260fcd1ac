"""``python -m rl_extension train preset=tiny-cpu key=value ...``: the same as ``spmdcall-rl``."""

import sys

from rl_extension.app.cli import main

sys.exit(main())
