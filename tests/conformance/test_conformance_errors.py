"""The suite's spmdcall/testing/test_errors.py, on every built-in backend."""

from spmdcall.testing.test_errors import *  # noqa: F403
