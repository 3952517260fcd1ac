"""Every test here starts threads or event loops that drive groups; none may leave shared memory behind."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="module")
def no_leftover_shared_memory():
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    yield
    if os.path.isdir("/dev/shm"):
        new = set(os.listdir("/dev/shm")) - before
        assert not new, f"shared-memory files left in /dev/shm: {sorted(new)}"
