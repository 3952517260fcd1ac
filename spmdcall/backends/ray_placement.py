"""The old name of :mod:`spmdcall.backends.ray.placement` (moved in 0.1.0), kept for code that
imports it: both names are the same module."""

import sys

from spmdcall.backends.ray import placement

sys.modules[__name__] = placement
