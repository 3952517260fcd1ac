"""The old name of :mod:`spmdcall.group.detached` (moved in 0.1.0), kept for code that imports it:
both names are the same module."""

import sys

from spmdcall.group import detached

sys.modules[__name__] = detached
