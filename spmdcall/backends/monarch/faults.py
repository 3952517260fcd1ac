"""Keeping Monarch from exiting the controller when a rank of a ``monarch`` group dies.

Monarch reports the failure of an actor mesh that nobody supervises to
``monarch.actor.unhandled_fault_hook``, whose default exits the controller. The backend reports a
dead rank itself (``WorkerDiedError``, and ``restart()`` brings it back), so while monarch groups
live a hook is chained in front of whatever hook is installed: it logs the failures of the
groups' meshes (and of the logger meshes Monarch starts beside every proc mesh) and hands every
other failure to the hook it found. The names stay after a group shuts down: Monarch may report
a process of the group (one a restart replaced) seconds later. Failures of a group being shut
down are expected (a rank busy in a call when its process is stopped is reported failed) and
logged at DEBUG only.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import monarch.actor

_log = logging.getLogger("spmdcall.monarch")


class _Chain:
    """The hook in front: the mesh names of live groups, and the hook it found."""

    def __init__(self, previous: Any):
        self.previous = previous
        self.names: set[str] = set()
        self.stopped: set[str] = set()  # names of groups shut down: their failures are expected

    def __call__(self, failure: Any) -> None:
        name = str(getattr(failure, "mesh_name", "")).lower()  # Monarch lowercases mesh names
        if any(name.startswith(n) for n in self.stopped):
            _log.debug("a rank of a monarch group stopped as the group shut down: %s", failure)
            return None
        if any(name.startswith(n) for n in self.names) or name.startswith("logger-"):
            _log.warning("a rank of a monarch group failed (the group reports it): %s", failure)
            return None
        return self.previous(failure)


_lock = threading.Lock()


def install(mesh_name: str) -> None:
    """Keep the failures of meshes whose names start with ``mesh_name`` from exiting the controller."""
    with _lock:
        hook = monarch.actor.unhandled_fault_hook
        if not isinstance(hook, _Chain):
            hook = monarch.actor.unhandled_fault_hook = _Chain(hook)
        hook.names.add(mesh_name.lower())


def stopping(mesh_name: str) -> None:
    """The group of ``mesh_name`` is shutting down: its meshes' failures from now on are expected."""
    with _lock:
        hook = monarch.actor.unhandled_fault_hook
        if isinstance(hook, _Chain):
            hook.stopped.add(mesh_name.lower())
