"""The suite's spmdcall/testing/test_reports.py, on every built-in backend."""

from spmdcall.testing.test_reports import *  # noqa: F403
