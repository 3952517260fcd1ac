"""Where the Monarch logs of a ``monarch`` group go, and how the user finds them.

Monarch 0.7 writes each process's own log (its Rust runtime's events: procs and actors created,
messages undeliverable, supervision) to ``/tmp/<user>/monarch_log.log`` on that process's host.
The folder is fixed; only the name changes, with the environment variable ``MONARCH_LOG_SUFFIX``
that a process reads when it starts: ``monarch_log_<suffix>.log``. So every rank on this host is
started with a suffix of its own (the group's mesh name and the rank), through the bootstrap
command Monarch starts the process with, not through this process's environment; each rank says
where its file is (``worker_info()``, ``"monarch_log"``), and with ``log_dir=`` the controller
links the files of this host's ranks into that folder. A worker's ``print`` output is not in
these files: it goes to the controller's own stdout and stderr, as on the ``process`` backend.
"""

from __future__ import annotations

import contextlib
import os
import pwd
from collections.abc import Callable
from typing import Any

SUFFIX_VAR = "MONARCH_LOG_SUFFIX"  # read by Monarch's logging when a process starts


def suffix(mesh_name: str, rank: int) -> str:
    return f"{mesh_name}-rank{rank}"


def bootstrap(mesh_name: str, first_rank: int) -> Callable[[Any], Any]:
    """The bootstrap command of each process of a proc mesh on this host whose first process is
    rank ``first_rank``: Monarch's default one, with the rank's log suffix added."""
    from monarch.actor import default_bootstrap_cmd

    base = default_bootstrap_cmd()

    def command(point: Any) -> Any:
        return base.with_env({SUFFIX_VAR: suffix(mesh_name, first_rank + point["procs"])})

    return command


def own_log_path() -> str | None:
    """The Monarch log file of this process (``/tmp/<user>/monarch_log[_<suffix>].log``), or None
    when there is none where Monarch 0.7 puts it."""
    try:
        user = pwd.getpwuid(os.getuid()).pw_name or "monarch"
    except KeyError:
        user = "monarch"
    name = os.environ.get(SUFFIX_VAR)
    path = os.path.join("/tmp", user, f"monarch_log{'_' + name if name else ''}.log")
    return path if os.path.isfile(path) else None


def link(path: str | None, log_dir: str, name: str) -> str | None:
    """A link named ``name`` in ``log_dir`` to the log file ``path`` of this host (a hard link,
    which outlives a clean-up of /tmp; a symbolic one across file systems); the link's path, or
    None when there is no file. A link already there (a restarted rank's) is kept."""
    if path is None:
        return None
    os.makedirs(log_dir, exist_ok=True)
    target = os.path.join(log_dir, name)
    if os.path.lexists(target):
        return target
    try:
        os.link(path, target)
    except OSError:
        with contextlib.suppress(FileExistsError):
            os.symlink(path, target)
    return target
