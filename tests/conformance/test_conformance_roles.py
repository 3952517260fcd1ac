"""The suite's spmdcall/testing/test_roles.py, on every built-in backend."""

from spmdcall.testing.test_roles import *  # noqa: F403
