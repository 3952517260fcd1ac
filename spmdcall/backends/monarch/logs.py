"""Where the Monarch logs of a ``monarch`` group go, and how the user finds them.

Monarch 0.7 writes each process's own log (its Rust runtime's events: procs and actors created,
messages undeliverable, supervision) to ``/tmp/<user>/monarch_log.log`` on that process's host.
The folder is fixed; only the name changes, with the environment variable ``MONARCH_LOG_SUFFIX``
that a process reads when it starts: ``monarch_log_<suffix>.log``. So every rank on this host is
started with a suffix of its own (the group's mesh name and the rank), through the bootstrap
command Monarch starts the process with, not through this process's environment; each rank says
where its file is (``worker_info()``, ``"monarch_log"``), and the controller links the files of
this host's ranks into a folder of the user's: ``log_dir=``, else :func:`default_dir`. Once a
rank's process is gone, its file is left only there (``settle``): nothing piles up in the shared
``/tmp/<user>``. A worker's ``print`` output is not in these files: it goes to the controller's
own stdout and stderr, as on the ``process`` backend.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
from collections.abc import Callable
from typing import Any

SUFFIX_VAR = "MONARCH_LOG_SUFFIX"  # read by Monarch's logging when a process starts
DIR_VAR = "SPMDCALL_LOG_DIR"


def default_dir() -> str:
    """The folder for the rank logs of a group started without ``log_dir=``: ``$SPMDCALL_LOG_DIR``,
    else ``$XDG_STATE_HOME/spmdcall/logs`` (``~/.local/state/spmdcall/logs``)."""
    if os.environ.get(DIR_VAR):
        return os.environ[DIR_VAR]
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "spmdcall", "logs")


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


def link_name(path: str | None) -> str:
    """The name of the link to the log file ``path`` (``monarch_log_<suffix>.log``): ``<suffix>.log``."""
    base = os.path.basename(path or "")
    return base[len("monarch_log_") :] if base.startswith("monarch_log_") else base


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


def settle(original: str | None, linked: str | None) -> None:
    """Leave the log file ``original`` (whose process is gone) only at ``linked``, its link in the
    user's folder: a hard link keeps the file when the ``/tmp`` name goes; a symbolic one is
    replaced by a copy of the file first."""
    if original is None or linked is None or not os.path.isfile(original):
        return
    with contextlib.suppress(OSError):
        if os.path.islink(linked):
            shutil.copyfile(original, linked + ".part")
            os.replace(linked + ".part", linked)
        if os.path.samefile(original, linked):
            os.unlink(original)
