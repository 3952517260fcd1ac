"""The suite's spmdcall/testing/test_resize.py, on every built-in backend."""

from spmdcall.testing.test_resize import *  # noqa: F403
