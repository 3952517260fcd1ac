"""The suite's spmdcall/testing/test_calls.py, on every built-in backend."""

from spmdcall.testing.test_calls import *  # noqa: F403
