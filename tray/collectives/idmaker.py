"""The process that makes a tray's NCCL unique ids for the ranks' early join, and holds their bootstrap roots.

ncclGetUniqueId opens a listening socket and starts a thread in the calling process, the group's bootstrap
root, which waits without a timeout until every member has connected. Made in the head, the root of a tray
that failed before its ranks joined stayed in the head until the head exited: one thread and one socket per
group instance per failed tray, kept across `--max-restarts` attempts and in a long-lived Python that runs
trays. The head therefore makes them here, in a child it starts in the tray's process group:

  python -m tray.collectives.idmaker COUNT

It writes one JSON line to stdout, {"ids": [hex, ...], "made_s": s} or {"error": why, "made_s": s}, then lives
until every root it started has served its members (its thread count is back to what it was before the
first id), or until its stdin closes (the head is done, or gone). The tray's teardown kills its process
group, and so this process, in any case: no root outlives its tray.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable

from tray.collectives.base import UNIQUE_ID_NBYTES
from tray.envvars import own_module
from tray.errors import DeviceError
from tray.text import is_digits

ANSWER_TIMEOUT_S = 20.0  # the head's wait for the ids; past it the ranks join lazily (a loaded host's start)
_POLL_S = 0.02  # how often the process looks whether its roots are done
_EXIT_WAIT_S = 1.0  # for the exit status of a process whose stdout ended without ids


def unique_id_maker() -> Callable[[], bytes]:
    """ncclGetUniqueId through ctypes, on the libnccl that nccl4py loads (cuda.pathfinder finds it), for the head's
    id process: without nccl4py's import (numpy, cuda.core: ~0.4 s on the H200 host to make the ids through it)
    and without CUDA. Raises ImportError or cuda.pathfinder's error where either is missing (then
    `tray.collectives.nccl.get_unique_id`)."""
    import ctypes

    from cuda.pathfinder import load_nvidia_dynamic_lib

    fn = ctypes.CDLL(load_nvidia_dynamic_lib("nccl").abs_path).ncclGetUniqueId
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_int

    def make() -> bytes:
        buf = ctypes.create_string_buffer(UNIQUE_ID_NBYTES)
        status = fn(buf)
        if status != 0:
            raise DeviceError(f"ncclGetUniqueId returned ncclResult {status}: NCCL's bootstrap needs a network "
                              "interface and a listening socket; NCCL_DEBUG=INFO says which it tried")
        return buf.raw

    return make


def thread_count() -> int:
    """This process's threads (/proc/self/task)."""
    return len(os.listdir("/proc/self/task"))


def wait_for_roots(before: int, stdin_fd: int, count: Callable[[], int] = thread_count,
                   poll_s: float = _POLL_S) -> str:
    """Until the roots are done ("served": `count()` back to `before`) or `stdin_fd` reaches its end
    ("released"). Bytes read from stdin are ignored."""
    while True:
        if count() <= before:
            return "served"
        readable, _, _ = select.select([stdin_fd], [], [], poll_s)
        if readable and not os.read(stdin_fd, 4096):
            return "released"


def _make(count: int) -> dict[str, object]:
    try:
        make = unique_id_maker()
    except Exception:  # no cuda.pathfinder, or it finds no libnccl: nccl4py's own way
        from tray.collectives.nccl import get_unique_id as make
    return {"ids": [make().hex() for _ in range(count)]}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not is_digits(args[0]):
        print(f"usage: python -m tray.collectives.idmaker COUNT (a number of ids), got {args}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    before = thread_count()
    try:
        answer = _make(int(args[0]))
    except Exception as exc:  # NOTE: said to the head, which writes it for the ranks: they join lazily
        answer = {"error": str(exc) or repr(exc)}
    answer["made_s"] = time.perf_counter() - t0
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
    if "ids" in answer:
        wait_for_roots(before, sys.stdin.fileno())
    return 0


class IdMaker:
    """The head's handle on its id process: started in process group `process_group` (the tray's), so the
    tray's teardown and its watchdog reach it. `answer()` gives the ids; `close()` ends and reaps it."""

    def __init__(self, count: int, process_group: int) -> None:
        # the head's environment: NCCL_SOCKET_IFNAME and the like choose the roots' address, as in the head
        cmd, env = own_module("tray.collectives.idmaker", str(count))
        self.count = count
        self.t_start = time.perf_counter()
        self.popen = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, process_group=process_group,
                                      env=env, close_fds=True)

    def answer(self, timeout_s: float = ANSWER_TIMEOUT_S) -> list[bytes]:
        """The `count` ids. DeviceError saying why when NCCL could not make them, when the process ended or
        closed its stdout without them, or after `timeout_s`."""
        assert self.popen.stdout is not None
        fd = self.popen.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise DeviceError(f"the head's NCCL id process (pid {self.popen.pid}) gave no ids within "
                                  f"{timeout_s:g} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                try:
                    rc: int | None = self.popen.wait(timeout=_EXIT_WAIT_S)  # its stdout ended: it exits, or was killed
                except subprocess.TimeoutExpired:
                    rc = None
                raise DeviceError(f"the head's NCCL id process (pid {self.popen.pid}) ended without ids"
                                  + (f" (exit status {rc})" if rc is not None else "") + "; its stderr is the head's")
            line += chunk
        try:
            body = json.loads(line)
            if "ids" not in body:
                raise DeviceError(str(body.get("error", "no ids and no reason")))
            ids = [bytes.fromhex(u) for u in body["ids"]]
        except (ValueError, TypeError, AttributeError) as exc:
            raise DeviceError(f"the head's NCCL id process answered {line[:200]!r}: {exc}") from None
        if len(ids) != self.count:
            raise DeviceError(f"the head's NCCL id process gave {len(ids)} ids, expected {self.count}")
        return ids

    def close(self, timeout_s: float = 5.0) -> int | None:
        """Close its stdin (it exits: its roots are not needed once the tray is down), kill it if it did not,
        reap it. Returns its exit status (None when it survived SIGKILL for `timeout_s`). Idempotent."""
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except OSError:
                    pass
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            try:
                return self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return None


if __name__ == "__main__":
    sys.exit(main())
