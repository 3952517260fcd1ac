"""The suite's spmdcall/testing/test_cancel.py, on every built-in backend."""

from spmdcall.testing.test_cancel import *  # noqa: F403
