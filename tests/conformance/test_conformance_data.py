"""The suite's spmdcall/testing/test_data.py, on every built-in backend."""

from spmdcall.testing.test_data import *  # noqa: F403
