"""The rank's side of the rendezvous: a ZeroMQ DEALER to the head, plus a heartbeat thread.

The main socket is used by the rank's main thread only (ZeroMQ sockets are not thread-safe); the
heartbeat thread owns a second DEALER so a rank busy in its program still proves it is alive.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import zmq

from tray.errors import HandshakeError, UsageError
from tray.handshake import HEARTBEAT_INTERVAL_S, wire

_POLL_AT_MOST_S = 3600.0  # one poll's longest wait (zmq takes the timeout as a C int of ms)


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

    def __init__(self, endpoint: str, token: str, rank: int) -> None:
        self.rank = rank
        self.token = token
        self.phase = "start"
        self._ctx = zmq.Context()
        self._sock = self._connect(endpoint, f"rank-{rank}")
        self._stop = threading.Event()
        self._step = threading.Lock()  # held by the thread making a tray-wide step on the main socket (step())
        self._step_of = ("", "", "")  # that thread's name and its step, for the refusal of another's
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
        (UsageError), naming both."""
        if not self._step.acquire(blocking=False):
            holder, held_kind, held_topic = self._step_of
            raise UsageError(f"rank {self.rank}: {kind} {topic!r} in thread {threading.current_thread().name!r} while "
                             f"thread {holder!r} waits in {held_kind} {held_topic!r}: a rank's tray-wide steps "
                             "(exchange, the collectives' first use, park and wake, barriers over groups that span "
                             "nodes) share its one connection to the head, one step at a time; make them from one "
                             "thread, or one after the other")
        try:
            self._step_of = (threading.current_thread().name, kind, topic)
            yield
        finally:
            self._step.release()

    def send(self, msg: Any) -> None:
        self._sock.send(wire.encode(msg))

    def send_bytes(self, data: bytes) -> None:
        """Send a message already encoded with wire.encode (to check its size first)."""
        self._sock.send(data)

    def receive(self, expected: type, timeout_s: float, waiting_for: str) -> Any:
        """The next message of type `expected`; raises on Reject or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not self._sock.poll(int(min(left, _POLL_AT_MOST_S) * 1000), zmq.POLLIN):
                if left > _POLL_AT_MOST_S:
                    continue  # a long wait (an endless one is 1e9 s) polls in parts zmq can take
                raise HandshakeError(
                    f"rank {self.rank}: no {waiting_for} from the head within {timeout_s:.1f} s " + (
                        _head_stopped() or "(the head waits for every rank; see its report for who is missing)")
                )
            msg = wire.decode(self._sock.recv(), token=self.token, sender="the head")
            if isinstance(msg, expected):
                return msg
            if isinstance(msg, wire.Reject):
                raise HandshakeError(f"the head refused a message of rank {self.rank}: {msg.reason}")
            # anything else is stale (e.g. a decision for an old round): skip it

    def close(self) -> None:
        self._stop.set()
        self._hb.join(timeout=2.0)
        self._sock.close()
        self._ctx.term()
