"""fd passing: each rank serves its exported fds on a UNIX socket (SCM_RIGHTS) to tray members only.

The server checks SO_PEERCRED (same uid, a pid the tray table lists) and the job token before it
sends anything. ZeroMQ cannot carry fds, hence this side channel.
"""

from __future__ import annotations

import errno
import hmac
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable

import msgpack

from tray.errors import HandshakeError, SetupError

# NOTE: requests and replies are tiny (names of a few buffers); a cap keeps garbage cheap.
_MAX_REQUEST_NBYTES = 64 * 1024
_REQUEST_WITHIN_S = 5.0  # a member's request, read whole within this (a trickle is cut off)
# NOTE: Linux SCM_MAX_FD is 253 fds per sendmsg.
_MAX_FDS = 253
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a UNIX socket."""
    pid, uid, _gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def _recv_exact(conn: socket.socket, nbytes: int, deadline: float | None = None) -> bytes:
    """`nbytes` from `conn`; with `deadline` (monotonic), TimeoutError once it passes, however the bytes trickle."""
    chunks = []
    while nbytes:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request did not arrive in time")
            conn.settimeout(left)
        chunk = conn.recv(nbytes)
        if not chunk:
            raise ConnectionError("peer closed the fd socket mid-message")
        chunks.append(chunk)
        nbytes -= len(chunk)
    return b"".join(chunks)


class FdServer:
    """Serves `fds` (name -> fd, owned by the caller) at `path` to the pids of the tray table."""

    def __init__(self, path: str, token: str, rank: int, fds: dict[str, int]) -> None:
        self.path = path
        self.rank = rank
        self.refusals: list[str] = []
        self._token = token
        self._fds = dict(fds)
        self._allowed: frozenset[int] | None = None
        self._table_ready = threading.Event()
        self._stop = threading.Event()
        # NOTE: one descriptor held in reserve: with none free, accept() fails (EMFILE) and the asking member would
        # wait on its connection until its timeout; the reserve, let go for the moment, answers it why instead
        self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except BaseException:
            os.close(self._spare)
            raise
        try:
            self._sock.bind(path)
            os.chmod(path, 0o600)
            self._sock.listen(64)
            self._sock.settimeout(0.1)
        except OSError as exc:
            self._sock.close()
            os.close(self._spare)
            gone = not os.path.isdir(os.path.dirname(path))
            raise SetupError(f"rank {rank} cannot make its fd socket {path}: {exc.strerror or exc}; "
                             + ("the job dir was removed while the tray started (by hand, or a cleanup of its "
                                "jobs root): leave it while the tray runs" if gone else
                                "free space or inodes there, or set TRAY_JOBS_ROOT to another directory")) from None
        except BaseException:
            self._sock.close()
            os.close(self._spare)
            raise
        self._thread = threading.Thread(target=self._serve, name=f"tray-fds-{rank}", daemon=True)
        self._thread.start()

    def allow(self, pids: Iterable[int]) -> None:
        """Set the tray table's pids; until then connections wait."""
        self._allowed = frozenset(pids)
        self._table_ready.set()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._refuse_without_fds():
                    continue
                return
            with conn:
                try:
                    self._answer(conn)
                except (OSError, ConnectionError, ValueError, msgpack.UnpackException) as exc:
                    self._refuse(conn, f"bad request: {exc}", log=True)

    def _refuse_without_fds(self) -> bool:
        """accept() found no descriptor free: the reserve let go, the waiting member is told why, the reserve taken
        back. False when that cannot be done (the serving thread then ends, as it did)."""
        if self._spare < 0:
            return False
        said = fd_limit_said()
        os.close(self._spare)
        self._spare = -1
        try:
            conn, _ = self._sock.accept()
        except OSError:
            conn = None
        if conn is not None:
            with conn:
                self._refuse(conn, f"rank {self.rank} has no file descriptor free to answer with: {said}; raise it "
                                   "(ulimit -n before the launch)")
        try:
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        return True

    def _refuse(self, conn: socket.socket, reason: str, log: bool = True) -> None:
        self.refusals.append(reason)
        if log:
            print(f"tray: rank {self.rank} fd socket: refused: {reason}", file=sys.stderr, flush=True)
        try:
            conn.sendall(_frame({"ok": False, "reason": reason}))
        except OSError:
            pass

    def _answer(self, conn: socket.socket) -> None:
        pid, uid = peer_credentials(conn)
        # NOTE: who asks is checked before anything is read: a stranger trickling its request in must not hold the
        # socket (one connection at a time) while the members wait. A member's request is read whole within
        # _REQUEST_WITHIN_S; its refusals then reach it instead of a reset.
        if uid != os.getuid():
            return self._refuse(conn, f"pid {pid} runs as uid {uid}, the tray as uid {os.getuid()}")
        if not self._table_ready.wait(timeout=30.0):
            return self._refuse(conn, f"pid {pid} asked before the tray table arrived")
        if self._allowed is None:  # close() ended the wait: this rank's start-up failed before its table came
            return self._refuse(conn, f"rank {self.rank} closed its fd socket before the tray table arrived (its "
                                      "start-up failed: its own report says why)", log=False)
        if pid not in self._allowed:
            return self._refuse(conn, f"pid {pid} is not a member of the tray table")
        deadline = time.monotonic() + _REQUEST_WITHIN_S
        try:
            (length,) = struct.unpack("!I", _recv_exact(conn, 4, deadline))
            if length > _MAX_REQUEST_NBYTES:
                return self._refuse(conn, f"request of {length} B exceeds {_MAX_REQUEST_NBYTES} B")
            request = msgpack.unpackb(_recv_exact(conn, length, deadline), raw=False)
        except TimeoutError:
            return self._refuse(conn, f"pid {pid}'s request did not arrive whole within {_REQUEST_WITHIN_S:g} s")
        conn.settimeout(5.0)
        if not isinstance(request, dict) or not hmac.compare_digest(
            str(request.get("token", "")).encode(), self._token.encode()
        ):
            return self._refuse(conn, f"pid {pid} sent a request without the job token")
        names = request.get("names")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return self._refuse(conn, "request 'names' must be a list of buffer names")
        unknown = [n for n in names if n not in self._fds]
        if unknown:
            return self._refuse(conn, f"unknown buffers {unknown}; this rank exports {sorted(self._fds)}",
                                log=False)
        for start in range(0, max(len(names), 1), _MAX_FDS):
            part = names[start:start + _MAX_FDS]
            header = _frame({"ok": True, "names": part, "more": start + _MAX_FDS < len(names)})
            socket.send_fds(conn, [header], [self._fds[n] for n in part])
        return None

    def close(self) -> None:
        self._stop.set()
        self._table_ready.set()  # a member waiting for the table is refused now, not after the wait's 30 s
        try:
            # wakes the serving thread's accept() now (Linux: EINVAL); a close alone leaves it blocked
            # until its 0.1 s timeout, which every rank's exit would wait for
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=2.0)
        if self._spare >= 0 and not self._thread.is_alive():
            os.close(self._spare)
            self._spare = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _frame(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack("!I", len(body)) + body


def _reply(sock: socket.socket, data: bytes, nfds: int, owner: str) -> tuple[list[str], bool]:
    """One reply of an fd socket, checked: (the buffer names its `nfds` fds are, whether more replies follow).
    Raises HandshakeError naming `owner` for a refusal or a reply of the wrong shape."""
    if len(data) < 4:
        raise HandshakeError(f"{owner}'s fd socket closed without an answer")
    (length,) = struct.unpack("!I", data[:4])
    body = data[4:]
    while len(body) < length:
        body += _recv_exact(sock, length - len(body))
    reply = msgpack.unpackb(body, raw=False)
    if not isinstance(reply, dict):
        raise HandshakeError(f"{owner}'s fd socket answered {type(reply).__name__}, not a map")
    if not reply.get("ok"):
        raise HandshakeError(f"{owner}'s fd socket refused: {reply.get('reason')}")
    names = reply.get("names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise HandshakeError(f"{owner}'s fd socket answered without the list of buffer names")
    if nfds != len(names):
        raise HandshakeError(f"{owner} sent {nfds} fds for {len(names)} buffers")
    return names, bool(reply.get("more"))


def fd_limit_said() -> str:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        now = f", {len(os.listdir('/proc/self/fd')) - 1} open now"  # less the listing's own
    except OSError:  # none free even to list them
        now = ""
    return f"its open-file limit is {soft} (at most {hard}){now}"


def fetch_fds(path: str, token: str, names: list[str], owner: str, timeout_s: float) -> dict[str, int]:
    """Ask the fd socket at `path` (of `owner`, e.g. "rank 2") for `names`; returns name -> fd
    (the caller owns and closes them). Raises HandshakeError naming the owner on refusal/timeout."""
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    received: dict[str, int] = {}
    try:
        while True:
            try:
                sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if time.monotonic() >= deadline:
                    raise HandshakeError(
                        f"{owner}'s fd socket {path} did not answer within {timeout_s:.1f} s ({exc})"
                    ) from None
                time.sleep(0.005)
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            sock.sendall(_frame({"token": token, "names": names}))
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the request was read (who asks is judged first): the refusal waits to be read
        while True:
            data, fds, flags, _addr = socket.recv_fds(sock, _MAX_REQUEST_NBYTES, _MAX_FDS)
            try:
                if flags & socket.MSG_CTRUNC:  # the kernel dropped the fds this process had no room for
                    raise HandshakeError(f"this rank could not receive {owner}'s fds: {fd_limit_said()}, and the "
                                         f"reply's fds beyond {len(fds)} were dropped; raise it (ulimit -n) or export "
                                         "fewer buffers")
                names, more = _reply(sock, data, len(fds), owner)
            except BaseException:
                for fd in fds:  # NOTE: this reply's fds are not in `received` yet: closed here, whatever failed
                    os.close(fd)
                raise
            received.update(zip(names, fds))
            if not more:
                return received
    except TimeoutError:
        for fd in received.values():
            os.close(fd)
        raise HandshakeError(f"{owner}'s fd socket {path}: no answer within {timeout_s:.1f} s") from None
    except (OSError, ValueError, msgpack.UnpackException) as exc:
        for fd in received.values():
            os.close(fd)
        raise HandshakeError(f"{owner}'s fd socket {path} failed: {exc}") from None
    except BaseException:
        for fd in received.values():
            os.close(fd)
        raise
    finally:
        sock.close()
