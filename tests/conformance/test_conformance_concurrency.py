"""The suite's spmdcall/testing/test_concurrency.py, on every built-in backend."""

from spmdcall.testing.test_concurrency import *  # noqa: F403
