"""The port of a group's ``torch.distributed`` rendezvous (``MASTER_PORT``), reserved until the group ends.

Rank 0 binds ``MASTER_PORT`` only when its code calls ``init_process_group`` (or ``sc.init_distributed``),
seconds after the group picked the port. Picking a free port and letting it go (bind to port 0, read it,
close) leaves that window open: any socket on the machine may be given the same port meanwhile (the
kernel hands it out again to ``bind(0)`` and to outgoing connections), and rank 0 then fails with
``EADDRINUSE``. So the port stays *reserved* instead: a socket bound to it with ``SO_REUSEADDR`` that
never listens, held for the group's life.

- The kernel gives a bound port to nobody else: ``bind`` to port 0 and ``connect`` skip it, and a
  plain ``bind`` to it fails.
- Rank 0's rendezvous server still binds it: torch's ``TCPStore`` (libuv or not) sets ``SO_REUSEADDR``,
  and Linux lets two such sockets share a port as long as at most one of them listens.
- A rank restarted by ``WorkerGroup.restart`` finds the same port still free for it.

A socket that sets ``SO_REUSEADDR`` itself and listens on the port first (a job that was told this
very port) can still take it. Then rank 0's error names ``EADDRINUSE`` and the port, and the backend
starts the group again on a new port (:data:`START_ATTEMPTS` in all, each retry logged):
:func:`port_taken` tells that error from any other.
"""

from __future__ import annotations

import logging
import socket

from spmdcall.errors import WorkerError

logger = logging.getLogger("spmdcall")

# How many times a backend starts a group whose rank 0 found its rendezvous port taken.
START_ATTEMPTS = 3


class PortReservation:
    """A TCP port held for a group's rendezvous: bound with ``SO_REUSEADDR``, never listening.

    Args:
        host: the address to bind (``""`` for every interface, as rank 0's rendezvous server does).
        port: the port to hold; 0 (the default) lets the kernel pick a free one.

    Raises ``OSError`` (``EADDRINUSE``) when ``port`` is held by a socket that does not share it.

    Example:
        >>> with PortReservation() as held:
        ...     0 < held.port < 65536
        True
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((host, port))
        except BaseException:
            self._socket.close()
            raise
        self.port: int = self._socket.getsockname()[1]

    def close(self) -> None:
        """Let the port go (idempotent)."""
        self._socket.close()

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._socket.fileno() < 0 else "held"
        return f"PortReservation(port={self.port}, {state})"


def port_taken(error: BaseException, port: int) -> bool:
    """Whether ``error`` is a rank failing to start because ``port`` (its rendezvous) was in use."""
    if not isinstance(error, WorkerError):
        return False
    text = error.remote_traceback
    return str(port) in text and ("EADDRINUSE" in text or "Address already in use" in text)


def log_retry(port: int, attempt: int) -> None:
    """One line saying that a group starts again because its rendezvous port was taken."""
    logger.warning(
        "spmdcall: rank 0 could not listen on rendezvous port %d (another socket took it); "
        "starting the group again on a new port (attempt %d of %d)",
        port,
        attempt + 1,
        START_ATTEMPTS,
    )
