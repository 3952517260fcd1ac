"""The old name of :mod:`spmdcall.group.modes` (moved in 0.1.0), kept for code that imports it:
both names are the same module."""

import sys

from spmdcall.group import modes

sys.modules[__name__] = modes
