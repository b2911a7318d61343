"""The rank's side of the rendezvous: a ZeroMQ DEALER to the head, plus a heartbeat thread.

ZeroMQ sockets are not thread-safe: the main socket is used by one thread at a time, the one making a tray-wide step
(`step()`), or, at the end, the one that sends the rank's last messages and closes it (`send_last()`, `close()`),
which first ends a step another thread waits in. The heartbeat thread owns a second DEALER so a rank busy in its
program still proves it is alive.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import zmq

from tray.errors import HandshakeError, UsageError
from tray.handshake import HEARTBEAT_INTERVAL_S, wire

_POLL_AT_MOST_S = 3600.0  # one poll's longest wait (zmq takes the timeout as a C int of ms)
# NOTE: how long the rank's last message (its error report, its bye) and the socket's close wait for a step that
# another thread makes to let go of the main socket; woken at once (its wait polls the wake fd too), it lets go within
# a few ms: past this, the message is not sent (the error file stands for the report; the head sees the rank's exit)
# and the socket is left to the process's end
LAST_WAIT_S = 2.0


def _head_stopped() -> str:
    """A note when the head (this rank's parent: it spawned the rank) is stopped now (Ctrl-Z, SIGSTOP), so that it
    can neither decide nor report; "" otherwise, or where /proc cannot tell."""
    head = os.getppid()
    try:
        with open(f"/proc/{head}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return ""
    if state not in (b"T", b"t"):
        return ""
    return (f"(the head, pid {head}, is stopped: Ctrl-Z or SIGSTOP; nothing is decided while it is, and it reports "
            f"nothing: `fg` in its shell, or kill -CONT {head}, resumes it)")


class RendezvousClient:
    """Talks to the head at `endpoint` as rank `rank`, signing every message with `token`."""

    def __init__(self, endpoint: str, token: str, rank: int, world_size: int = 1) -> None:
        """`world_size`: the job's ranks, which bound the size of the table and the decisions the head sends."""
        self.rank = rank
        self.token = token
        self.limit = wire.job_message_limit(world_size)
        self.phase = "start"
        self._ctx = zmq.Context()
        self._sock = self._connect(endpoint, f"rank-{rank}")
        self._stop = threading.Event()
        self._step = threading.Lock()  # held by the thread making a tray-wide step on the main socket (step())
        self._step_of = ("", "", "")  # that thread's name and its step, for the refusal of another's
        self._holder: int | None = None  # that thread's ident
        # once the rank's last message or its close began: the thread that did it, whether it has the socket (`_step`
        # taken for good: `_last`, held by whoever ends the socket's use, serializes them), and a wake fd made readable
        # then, so that a step's wait ends at once
        self._closing = ""
        self._taken = False
        self._last = threading.Lock()  # one thread at a time ends the socket's use
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake, zmq.POLLIN)
        self._hb = threading.Thread(target=self._heartbeat, args=(endpoint,), name="tray-heartbeat",
                                    daemon=True)
        self._hb.start()

    def _connect(self, endpoint: str, identity: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 2000)  # flush an error report before the process exits
        sock.setsockopt(zmq.RECONNECT_IVL, 10)
        sock.connect(endpoint)
        return sock

    def _heartbeat(self, endpoint: str) -> None:
        sock = self._connect(endpoint, f"rank-{self.rank}.hb")
        sock.setsockopt(zmq.LINGER, 0)
        seq = 0
        try:
            while not self._stop.is_set():
                msg = wire.Heartbeat(token=self.token, rank=self.rank, phase=self.phase, seq=seq)
                try:
                    sock.send(wire.encode(msg), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                seq += 1
                self._stop.wait(HEARTBEAT_INTERVAL_S)
        finally:
            sock.close()

    @contextlib.contextmanager
    def step(self, kind: str, topic: str) -> Iterator[None]:
        """The main socket for the calling thread's tray-wide step (`kind` "exchange", say, and its `topic`): its vote,
        then the wait for the decision. Another thread's step meanwhile would share the socket (not thread-safe) and
        each would skip the other's decision as stale, both waiting out their timeouts: it is refused at once
        (UsageError), naming both. Once the rank's last message or its close began, every step is refused (UsageError),
        and one waiting ends so (receive)."""
        if not self._step.acquire(blocking=False):
            if self._closing:
                raise self._closed(f"{kind} {topic!r}", "was refused")
            holder, held_kind, held_topic = self._step_of
            raise UsageError(f"rank {self.rank}: {kind} {topic!r} in thread {threading.current_thread().name!r} while "
                             f"thread {holder!r} waits in {held_kind} {held_topic!r}: a rank's tray-wide steps "
                             "(exchange, the collectives' first use, park and wake, barriers over groups that span "
                             "nodes) share its one connection to the head, one step at a time; make them from one "
                             "thread, or one after the other")
        try:
            if self._closing:  # begun as the rank closes: its socket is the closing thread's
                raise self._closed(f"{kind} {topic!r}", "was refused")
            self._step_of = (threading.current_thread().name, kind, topic)
            self._holder = threading.get_ident()
            yield
        finally:
            self._holder = None
            self._step.release()

    def _closed(self, what: str, how: str) -> UsageError:
        return UsageError(
            f"rank {self.rank}: {what} in thread {threading.current_thread().name!r} {how}: thread {self._closing!r} "
            "is closing the rank's tray (rank.close(), or the end of its `with tray.init()` block, which reports an "
            "exception leaving it first) and has its connection to the head; a rank's tray-wide steps end with its "
            "tray: end them, or the threads that make them, before it closes")

    def _take_socket(self, wait_s: float, what: str) -> bool:
        """Make the main socket the calling thread's for the rest of the rank's life (`_last` held): no step begins any
        more, one waiting on another thread ends at once (UsageError there) and lets go of it, waited for at most
        `wait_s`. False when it did not let go in time (a line on stderr names that thread, its step and `what` is
        given up), or when the calling thread itself waits in a step (a signal handler ran in it): then the socket
        must not be closed under that step."""
        if self._taken:  # by this thread, or by one that is done with it (`_last` is held)
            return True
        if not self._closing:
            self._closing = threading.current_thread().name
            os.eventfd_write(self._wake, 1)  # never read: every wait from here on ends at once
        if self._holder == threading.get_ident():
            return False
        if not self._step.acquire(timeout=wait_s):
            holder, kind, topic = self._step_of
            print(f"tray: rank {self.rank}: thread {holder!r} did not end its {kind} {topic!r} within {wait_s:.1f} s "
                  f"of thread {self._closing!r} closing the rank's tray (it runs code that never returns to the "
                  f"step's wait); {what}", file=sys.stderr, flush=True)
            return False
        self._taken = True
        return True

    def send_last(self, msg: Any, wait_s: float = LAST_WAIT_S) -> bool:
        """Send the rank's last message (its error report, its bye) on the main socket, which is this thread's from
        here on (`_take_socket`: a step another thread waits in ends, at once, with a UsageError). False when it was
        not sent: that step did not let go within `wait_s`, or the socket is closed."""
        with self._last:
            kind = getattr(msg, "KIND", type(msg).__name__)
            took = self._take_socket(wait_s, f"the rank's last message to the head ({kind}) is not sent")
            if not took and self._holder != threading.get_ident():
                return False
            if self._sock.closed:
                return False
            # NOTE: a step the calling thread itself waits in (a signal handler closing the rank) is below it on the
            # same thread, not beside it: a send from here does not share the socket with another thread
            self._sock.send(wire.encode(msg))
            return True

    def send(self, msg: Any) -> None:
        self._sock.send(wire.encode(msg))

    def send_bytes(self, data: bytes) -> None:
        """Send a message already encoded with wire.encode (to check its size first)."""
        self._sock.send(data)

    def receive(self, expected: type, timeout_s: float, waiting_for: str, since: float | None = None) -> Any:
        """The next message of type `expected`; raises on Reject or after `timeout_s` from `since` (a monotonic time:
        when the wait began, for a caller that skips stale messages of that type and receives again; default now)."""
        deadline = (time.monotonic() if since is None else since) + timeout_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            ready = self._poller.poll(int(min(left, _POLL_AT_MOST_S) * 1000))
            if self._closing:  # the rank's last message or its close: the socket is another thread's now
                in_step = self._holder == threading.get_ident()
                raise self._closed(f"{self._step_of[1]} {self._step_of[2]!r}" if in_step else
                                   f"the wait for the {waiting_for}", "ended unanswered")
            if not ready:
                if left > _POLL_AT_MOST_S:
                    continue  # a long wait (an endless one is 1e9 s) polls in parts zmq can take
                raise HandshakeError(
                    f"rank {self.rank}: no {waiting_for} from the head within {timeout_s:.1f} s " + (
                        _head_stopped() or "(the head waits for every rank; see its report for who is missing)")
                )
            msg = wire.decode(self._sock.recv(), token=self.token, sender="the head", limit=self.limit)
            if isinstance(msg, expected):
                return msg
            if isinstance(msg, wire.Reject):
                raise HandshakeError(f"the head refused a message of rank {self.rank}: {msg.reason}")
            # anything else is stale (e.g. a decision for an old round): skip it

    def close(self) -> None:
        """Stop the heartbeats and close the sockets. A step another thread waits in ends first (UsageError there);
        should it not let go within LAST_WAIT_S, the main socket and the context are left to the process's end
        rather than closed under it."""
        with self._last:
            took = self._take_socket(LAST_WAIT_S, "the connection to the head is left open until the process ends")
            self._stop.set()
            self._hb.join(timeout=2.0)
            if not took or self._sock.closed:
                return
            self._sock.close()
            os.close(self._wake)
            self._ctx.term()
