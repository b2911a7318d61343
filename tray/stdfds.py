"""The standard descriptors of a rank's process, filled before tray opens any of its own."""

from __future__ import annotations

import os


def fill_closed_std_fds() -> None:
    """Open /dev/null on whichever of fds 0, 1 and 2 the program closed, before tray opens any descriptor (tray.init()
    does it first): the kernel gives a new descriptor the lowest free number, so ZeroMQ's eventfd became fd 2, and
    the head's stack dump (faulthandler, writing to fd 2) aborted the rank in libzmq, or would have written into a
    buffer's memfd. /dev/null takes the lowest free number itself: where it does not land on the closed one (another
    thread of the program took it meanwhile), it is closed again and that descriptor left to its owner."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                null = os.open(os.devnull, os.O_RDWR)
            except OSError:
                return
            if null != fd:
                os.close(null)
                return
            os.set_inheritable(fd, True)  # as a standard stream is
