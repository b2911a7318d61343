"""A TCP port reserved for a job's torch rendezvous (MASTER_PORT), held by the head while the job runs."""

from __future__ import annotations

import socket

# NOTE: one host: ranks reach rank 0's store over loopback (torchrun's standalone mode does the same).
MASTER_ADDR = "127.0.0.1"


class PortReservation:
    """A free port, held by a bound (never listening) socket until `close()`.

    WHY held and not probed-then-freed: the port is picked by `bind(port 0)` without SO_REUSEADDR, so the
    kernel gives it to nobody else who binds it that way, such as another tray's head reserving its own.
    SO_REUSEADDR is set after the bind, so rank 0's torch TCPStore (which binds with SO_REUSEADDR and
    listens) can still bind it while this socket holds it: a non-listening holder does not conflict then.
    The window left open: a process that binds this exact port number by itself, without SO_REUSEADDR,
    fails with EADDRINUSE while the job runs; none can take it from under rank 0.
    """

    def __init__(self, host: str = MASTER_ADDR, port: int = 0) -> None:
        """`port` 0: a free one; else that one (OSError when it is taken)."""
        self.host = host
        self._sock: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if port:  # a port asked for: a connection of its last user left in TIME_WAIT must not refuse it
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        except BaseException:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
