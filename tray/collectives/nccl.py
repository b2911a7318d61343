"""NCCL collectives of a group on raw device addresses (cuda backend), through nccl4py's raw bindings.

Only this module and `tray/backend/cuda/` import `nccl`. The import is lazy (first call), so
`import tray.collectives.nccl` works where nccl4py is absent (CPU, CI); calling into it there raises
DeviceError saying how to get it.

nccl4py's high-level `nccl.core.Communicator` hung on the target machine; its raw
bindings work, so only these `nccl.bindings.nccl` calls are used (nccl4py 0.6.0 signatures):

    get_version() -> int                      get_unique_id() -> UniqueId (bytes() gives 128 bytes)
    UniqueId.from_buffer(b: 128 bytes)        get_error_string(int result) -> str
    group_start()  group_end()                comm_init_rank(int nranks, UniqueId comm_id, int rank) -> Comm
    comm_destroy(comm)  comm_abort(comm)      comm_get_async_error(comm) -> int
    get_last_error(comm) -> str               comm_cu_device(comm) -> int
    all_reduce(sendbuff, recvbuff, count, datatype, op, comm, stream)
    all_gather(sendbuff, recvbuff, sendcount, datatype, comm, stream)
    reduce_scatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)
    send(sendbuff, count, datatype, peer, comm, stream)   recv(recvbuff, count, datatype, peer, comm, stream)

Pointers and the stream are plain ints, datatype and op plain ints (nccl.h's enum values), `comm` a
`nccl.bindings.nccl.Comm` (a plain int is refused). A failing call raises `nccl.bindings.nccl.NCCLError`
(`.status` is the ncclResult_t); every such failure becomes a DeviceError here. NCCL_RUNTIME_CONNECT
is left as the launcher set it (0 for ranks unless the user set it), so captures make no connections.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from tray.backend.base import Collectives, GroupInfo, itemsize
from tray.collectives.base import UNIQUE_ID_NBYTES, GroupJoin, Joiner
from tray.errors import DeviceError, HandshakeError, UsageError

# manifest dtype -> (ncclDataType_t value from nccl.h, member name in nccl.bindings.nccl.DataType)
NCCL_DTYPES: dict[str, tuple[int, str]] = {
    "u8": (1, "Uint8"),
    "i8": (0, "Int8"),
    "i32": (2, "Int32"),
    "u32": (3, "Uint32"),
    "i64": (4, "Int64"),
    "u64": (5, "Uint64"),
    "f16": (6, "Float16"),
    "bf16": (9, "Bfloat16"),
    "f32": (7, "Float32"),
    "f64": (8, "Float64"),
}
_DTYPE_NAMES = {value: name for name, (value, _) in NCCL_DTYPES.items()}
RED_SUM = 0  # ncclSum; nccl.bindings.nccl.RedOp.Sum
_OP_NAMES = {RED_SUM: "sum"}

# ncclResult_t values
SUCCESS = 0
IN_PROGRESS = 7
RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}
_HINTS = {
    1: "a CUDA call inside NCCL failed: check the GPU (nvidia-smi) and that this rank's CUDA context "
       "is current",
    2: "a system call inside NCCL failed (shared memory, sockets, file limits)",
    3: "NCCL hit an internal error",
    4: "NCCL refused an argument: check the pointers (this device's memory), count and dtype",
    5: "NCCL calls arrived out of order: every member must make the same calls in the same order",
    6: "a peer rank failed: look for the root cause on the other ranks (the launcher names it first)",
    8: "a peer did not answer in time: a rank died or stalls",
}
_HEX_ARGS = frozenset({"sendbuff", "recvbuff", "stream", "comm_id"})

# NOTE: ncclCommDestroy returns only after every CUDA graph that captured work of the communicator is
# destroyed (NCCL keeps polling until those graphs die) and, being intra-node collective, after the other
# members destroy theirs; close() waits this long (TRAY_NCCL_CLOSE_TIMEOUT_S overrides) and then moves on.
CLOSE_TIMEOUT_S = 30.0
# after this long a collection runs once: a graph nobody references any more (in a cycle) is destroyed then
_CLOSE_COLLECT_AFTER_S = 0.5

_ALLREDUCE = ("sendbuff", "recvbuff", "count", "datatype", "op", "comm", "stream")
_ALLGATHER = ("sendbuff", "recvbuff", "sendcount", "datatype", "comm", "stream")
_REDUCESCATTER = ("sendbuff", "recvbuff", "recvcount", "datatype", "op", "comm", "stream")
_SEND = ("sendbuff", "count", "datatype", "peer", "comm", "stream")
_RECV = ("recvbuff", "count", "datatype", "peer", "comm", "stream")
_COMM = ("comm",)
_WINDOW = ("comm", "buff", "size", "winFlags")
WIN_COLL_SYMMETRIC = 0x01  # nccl.h: NCCL_WIN_COLL_SYMMETRIC

_bindings: Any = None


def _nccl() -> Any:
    """`nccl.bindings.nccl`, imported on first use and checked against the tables above."""
    global _bindings
    if _bindings is None:
        try:
            from nccl.bindings import nccl as mod
        except Exception as exc:  # ImportError, or a broken install failing at import
            raise DeviceError(
                f"NCCL is not available: importing nccl.bindings.nccl (package nccl4py) failed: {exc}. "
                "On the GPU machine run `scripts/gpu-wheels.sh install` and put its site on PYTHONPATH "
                "(eval \"$(scripts/gpu-wheels.sh env)\"); without a GPU use the host backend"
            ) from exc
        check_enums(mod)
        _bindings = mod
    return _bindings


def check_enums(mod: Any) -> None:
    """Raise DeviceError if the bindings' DataType/RedOp values differ from the tables here."""
    seen = []
    for name, (value, member) in NCCL_DTYPES.items():
        got = getattr(getattr(mod, "DataType", None), member, None)
        if got is not None and int(got) != value:
            seen.append(f"{name}: DataType.{member} = {int(got)}, expected {value}")
    got = getattr(getattr(mod, "RedOp", None), "Sum", None)
    if got is not None and int(got) != RED_SUM:
        seen.append(f"RedOp.Sum = {int(got)}, expected {RED_SUM}")
    if seen:
        raise DeviceError(
            "nccl.bindings.nccl enum values differ from nccl.h's (" + "; ".join(seen) + "): "
            "this nccl4py is not one tray supports; install the version pinned in scripts/gpu-wheels.sh"
        )


# --- pure helpers ---------------------------------------------------------------------------------


def nccl_dtype(dtype: str) -> int:
    """The ncclDataType_t value of a manifest dtype name; UsageError for types NCCL lacks."""
    try:
        return NCCL_DTYPES[dtype][0]
    except (KeyError, TypeError):
        raise UsageError(
            f"NCCL collectives take dtype {' '.join(NCCL_DTYPES)}; got {dtype!r}"
            + (" (NCCL has no 16-bit integer type: use f16/bf16 bits or widen to i32)"
               if dtype in ("u16", "i16") else "")
        ) from None


def decode_version(code: int) -> str:
    """NCCL's packed version (X*10000 + Y*100 + Z since 2.9, X*1000 + Y*100 + Z before) as 'X.Y.Z'."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _fmt_arg(name: str, value: Any) -> str:
    if name in _HEX_ARGS and isinstance(value, int):
        return f"{name}={value:#x}"
    if name == "datatype" and isinstance(value, int):
        return f"{name}={_DTYPE_NAMES.get(value, value)}"
    if name == "op" and isinstance(value, int):
        return f"{name}={_OP_NAMES.get(value, value)}"
    return f"{name}={value}"


def format_call(call: str, names: Sequence[str], args: Sequence[Any]) -> str:
    """`ncclSend(sendbuff=0x7f00, count=4, datatype=bf16, peer=1, stream=0x10)`; `comm` is left out
    (the message names the group instead)."""
    shown = ", ".join(_fmt_arg(n, a) for n, a in zip(names, args) if n != "comm")
    return f"{call}({shown})"


def error_status(exc: BaseException) -> int | None:
    """The ncclResult_t of a failed binding call (NCCLError.status), None for other exceptions."""
    status = getattr(exc, "status", None)
    try:
        return None if status is None else int(status)
    except (TypeError, ValueError):
        return None


def format_error(call: str, status: int | None, text: str, where: str = "", last_error: str = "") -> str:
    """One DeviceError message: what was called (with arguments), where, what NCCL said, what to do."""
    head = f"{call} in {where}" if where else call
    if status is None:
        msg = f"{head}: {text}"
    else:
        msg = f"{head}: {RESULT_NAMES.get(status, f'ncclResult {status}')}: {text}"
    if last_error and last_error not in text:
        msg += f"; NCCL's last error: {last_error}"
    hint = _HINTS.get(status) if status is not None else None
    if hint:
        msg += f"; {hint}"
    if "NCCL_DEBUG" not in msg:
        msg += "; rerun with NCCL_DEBUG=INFO for NCCL's own account"
    return msg


def _error_text(mod: Any, exc: BaseException | None, status: int | None) -> str:
    """NCCL's string for `status` (ncclGetErrorString), else the exception's own text."""
    if status is not None and mod is not None:
        with contextlib.suppress(Exception):  # the library may be what failed: fall back to exc's text
            return str(mod.get_error_string(status))
    if exc is None:
        return f"ncclResult {status}"
    return str(exc) if status is not None else f"{type(exc).__name__}: {exc}"


def close_timeout_s() -> float:
    """How long NcclGroup.close() waits for ncclCommDestroy: `TRAY_NCCL_CLOSE_TIMEOUT_S`, else
    CLOSE_TIMEOUT_S. UsageError for a value that is not a positive number."""
    raw = os.environ.get("TRAY_NCCL_CLOSE_TIMEOUT_S", "")
    if not raw:
        return CLOSE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"TRAY_NCCL_CLOSE_TIMEOUT_S must be a positive number of seconds, got {raw!r}")
    return value


def describe(group: GroupInfo) -> str:
    """`group 'tp0' (member 1 of 2, ranks (2, 3))`"""
    return f"group {group.name!r} (member {group.index} of {group.size}, ranks {group.members})"


def _run(call: str, names: Sequence[str], fn: Any, *args: Any) -> Any:
    """A binding call outside any communicator; failures become DeviceError."""
    try:
        return fn(*args)
    except Exception as exc:
        status = error_status(exc)
        mod = _bindings
        raise DeviceError(format_error(format_call(call, names, args), status,
                                       _error_text(mod, exc, status))) from exc


def _as_comm(mod: Any, comm: Any) -> Any:
    comm_type = getattr(mod, "Comm", None)
    if comm_type is None or isinstance(comm, comm_type):
        return comm
    return comm_type(int(comm))


# --- module functions ------------------------------------------------------------------------------


def version() -> str:
    """The loaded libnccl's version, e.g. '2.28.9'."""
    mod = _nccl()
    return decode_version(int(_run("ncclGetVersion", (), mod.get_version)))


def get_unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes) for a group this rank leads."""
    mod = _nccl()
    uid = bytes(_run("ncclGetUniqueId", (), mod.get_unique_id))
    if len(uid) != UNIQUE_ID_NBYTES:
        raise DeviceError(f"ncclGetUniqueId returned {len(uid)} bytes, expected {UNIQUE_ID_NBYTES}")
    return uid


# --- one group -------------------------------------------------------------------------------------


class NcclGroup(Collectives):
    """One joined NCCL communicator. Every call is enqueued on `stream` (or the caller's `stream=`, which
    a CUDA graph capture of the caller's may record: no call here synchronises); any failing call aborts the
    communicator (comm_abort) before raising DeviceError, and later calls are refused.

    `count` is in elements of `dtype`; for allgather, reducescatter and alltoall it is the per-member
    chunk (what each member sends to / receives from one member), as on the host backend."""

    device_memory = True  # NCCL reads and writes device memory only

    def __init__(self, group: GroupInfo, comm: Any, stream: int, device: int | None = None) -> None:
        self.group = group
        self.comm = comm
        self.stream = int(stream)
        self.device = device
        self._mod = _nccl()
        self._where = describe(group) + (f" on device {device}" if device is not None else "")
        self._state = "open"  # -> "closed" (destroyed) | "aborted"
        self._failure = ""
        self._in_group = 0  # depth of group_start calls this object made and has not ended
        self._windows: list[Any] = []  # registered with register_window; deregistered before the destroy

    def __repr__(self) -> str:
        return f"NcclGroup({self._where}, {self._state})"

    def _stream(self, stream: int | None) -> int:
        """The stream a call is enqueued on: the caller's (an int handle, 0 = the default stream) or the
        rank's own."""
        return self.stream if stream is None else int(stream)

    # --- collectives -------------------------------------------------------------------------------
    def allreduce(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                  stream: int | None = None) -> None:
        """recv[:count] = sum over members of their send[:count]."""
        self._live("ncclAllReduce")
        self._call("ncclAllReduce", _ALLREDUCE, self._mod.all_reduce,
                   send_ptr, recv_ptr, count, nccl_dtype(dtype), RED_SUM, self.comm, self._stream(stream))

    def allgather(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                  stream: int | None = None) -> None:
        """recv[i*count:(i+1)*count] = member i's send[:count]."""
        self._live("ncclAllGather")
        self._call("ncclAllGather", _ALLGATHER, self._mod.all_gather,
                   send_ptr, recv_ptr, count, nccl_dtype(dtype), self.comm, self._stream(stream))

    def reducescatter(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                      stream: int | None = None) -> None:
        """recv[:count] = sum over members of their send[me*count:(me+1)*count]."""
        self._live("ncclReduceScatter")
        self._call("ncclReduceScatter", _REDUCESCATTER, self._mod.reduce_scatter,
                   send_ptr, recv_ptr, count, nccl_dtype(dtype), RED_SUM, self.comm, self._stream(stream))

    def alltoall(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                 stream: int | None = None) -> None:
        """recv[i*count:(i+1)*count] = member i's send[me*count:(me+1)*count]: one NCCL group of a
        send and a recv of `count` elements per member (itself included)."""
        self._live("alltoall")
        dt = nccl_dtype(dtype)
        chunk = count * itemsize(dtype)
        with self.batch():
            for peer in range(self.group.size):
                self._call("ncclSend", _SEND, self._mod.send,
                           send_ptr + peer * chunk, count, dt, peer, self.comm, self._stream(stream))
                self._call("ncclRecv", _RECV, self._mod.recv,
                           recv_ptr + peer * chunk, count, dt, peer, self.comm, self._stream(stream))

    def alltoall_among(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, members: Sequence[int],
                       stream: int | None = None) -> None:
        """alltoall's blocks with the members `members` only: one NCCL group of a send and a recv of
        `count` elements per listed member."""
        self._live("alltoall")
        dt = nccl_dtype(dtype)
        chunk = count * itemsize(dtype)
        with self.batch():
            for peer in members:
                self._call("ncclSend", _SEND, self._mod.send,
                           send_ptr + peer * chunk, count, dt, self._peer(peer), self.comm, self._stream(stream))
                self._call("ncclRecv", _RECV, self._mod.recv,
                           recv_ptr + peer * chunk, count, dt, self._peer(peer), self.comm, self._stream(stream))

    def send(self, ptr: int, count: int, dtype: str, peer_index: int, stream: int | None = None) -> None:
        """Send `count` elements to member `peer_index`, which must post the matching recv (pair
        them inside `batch()` when both sides send and receive)."""
        self._live("ncclSend")
        self._call("ncclSend", _SEND, self._mod.send,
                   ptr, count, nccl_dtype(dtype), self._peer(peer_index), self.comm, self._stream(stream))

    def recv(self, ptr: int, count: int, dtype: str, peer_index: int, stream: int | None = None) -> None:
        """Receive `count` elements from member `peer_index`."""
        self._live("ncclRecv")
        self._call("ncclRecv", _RECV, self._mod.recv,
                   ptr, count, nccl_dtype(dtype), self._peer(peer_index), self.comm, self._stream(stream))

    def sendrecv(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, peer_index: int,
                 stream: int | None = None) -> None:
        """Exchange `count` elements with member `peer_index` (one grouped send + recv)."""
        with self.batch():
            self.send(send_ptr, count, dtype, peer_index, stream)
            self.recv(recv_ptr, count, dtype, peer_index, stream)

    def register_window(self, ptr: int, nbytes: int) -> None:
        """See Collectives.register_window: ncclCommWindowRegister(comm, ptr, nbytes, NCCL_WIN_COLL_SYMMETRIC).
        `ptr` must be VMM memory exportable as a POSIX fd (every tray buffer is). UsageError where this NCCL has
        no windows (before 2.27)."""
        self._live("ncclCommWindowRegister")
        if not hasattr(self._mod, "comm_window_register"):
            raise UsageError(f"{self._where}: NCCL {version()} has no windows (ncclCommWindowRegister: 2.27 or "
                             "later)")
        if nbytes <= 0:
            raise UsageError(f"{self._where}: a window of {nbytes} bytes; expected a positive size")
        win = self._call("ncclCommWindowRegister", _WINDOW, self._mod.comm_window_register,
                         self.comm, ptr, nbytes, WIN_COLL_SYMMETRIC)
        self._windows.append(win)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Fuse the calls made inside into one NCCL group (ncclGroupStart ... ncclGroupEnd).

        An exception inside aborts the communicator (and propagates): the calls already posted
        would run at ncclGroupEnd without their partners and leave the peers waiting."""
        self._live("ncclGroupStart")
        self._call("ncclGroupStart", (), self._mod.group_start)
        self._in_group += 1
        ok = False
        try:
            yield
            ok = True
        finally:
            if self._in_group:  # else a failed call inside has already ended the group and aborted
                self._in_group -= 1
                if ok:
                    self._call("ncclGroupEnd", (), self._mod.group_end)
                elif self._state == "open":
                    with contextlib.suppress(Exception):
                        self._mod.group_end()
                    self._failure = "an exception inside batch() on " + self._where
                    self._abort_quietly()

    # --- state -------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise DeviceError (and abort) if NCCL reports an asynchronous error on this communicator,
        e.g. a peer that died mid-collective. Cheap: no synchronisation."""
        self._live("ncclCommGetAsyncError")
        result = self._call("ncclCommGetAsyncError", _COMM, self._mod.comm_get_async_error, self.comm)
        status = int(result)
        if status not in (SUCCESS, IN_PROGRESS):
            raise self._fail(
                format_error("ncclCommGetAsyncError", status, _error_text(self._mod, None, status),
                             self._where, self._last_error())
            )

    def close(self) -> None:
        """Destroy the communicator (ncclCommDestroy). Idempotent; a no-op after abort(). Every member
        must close: destroy synchronises with the other members of the node, and NCCL destroys a
        communicator only after every CUDA graph that captured its collectives is gone (destroy a
        `torch.cuda.CUDAGraph` that captured them, e.g. `del graph`, before `rank.close()`).

        Waits at most `close_timeout_s()`; past it a RuntimeWarning names what is still waited for and the
        communicator is left to the process's end. Raises DeviceError (after an abort) if NCCL fails."""
        if self._state != "open":
            return
        timeout_s = close_timeout_s()
        self._state = "closed"
        done = threading.Event()
        failure: list[Exception] = []

        windows, self._windows = self._windows, []

        def destroy() -> None:
            try:
                for win in windows:  # NOTE: a window goes before its communicator
                    self._mod.comm_window_deregister(self.comm, win)
                self._mod.comm_destroy(self.comm)
            except Exception as exc:
                failure.append(exc)
            finally:
                done.set()

        # on a thread: a destroy that waits for a graph or a member must not hang the rank forever
        threading.Thread(target=destroy, name=f"tray-nccl-destroy-{self.group.name}", daemon=True).start()
        if not done.wait(min(_CLOSE_COLLECT_AFTER_S, timeout_s)):
            gc.collect()
            done.wait(max(0.0, timeout_s - _CLOSE_COLLECT_AFTER_S))
        if not done.is_set():
            warnings.warn(
                f"ncclCommDestroy on {self._where} did not return within {timeout_s:g} s: NCCL destroys a "
                "communicator only after every CUDA graph that captured its collectives is destroyed, and "
                "after the other members of the node destroy theirs. Destroy such graphs (e.g. `del graph` "
                "for a torch.cuda.CUDAGraph captured with stream=) before rank.close(), and check that every "
                "rank reaches close(); this communicator is left to the process's end "
                "(TRAY_NCCL_CLOSE_TIMEOUT_S sets the wait)",
                RuntimeWarning, stacklevel=2)
            return
        if failure:
            exc = failure[0]
            status = error_status(exc)
            msg = format_error(format_call("ncclCommDestroy", _COMM, (self.comm,)), status,
                               _error_text(self._mod, exc, status), self._where)
            raise DeviceError(msg + self._abort_quietly()) from exc

    def abort(self) -> None:
        """Abort the communicator (ncclCommAbort): ends in-flight work, frees it. Idempotent."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._failure = "abort() was called"
        try:
            self._mod.comm_abort(self.comm)
        except Exception as exc:
            status = error_status(exc)
            raise DeviceError(format_error(format_call("ncclCommAbort", _COMM, (self.comm,)), status,
                                           _error_text(self._mod, exc, status), self._where)) from exc

    # --- internals ---------------------------------------------------------------------------------
    def _live(self, call: str) -> None:
        if self._state == "open":
            return
        if self._state == "closed":
            raise UsageError(f"{call} on {self._where} after close(): join the group again first")
        raise DeviceError(f"{call} refused on {self._where}: its communicator was aborted after "
                          f"{self._failure}")

    def _peer(self, peer_index: int) -> int:
        if not isinstance(peer_index, int) or not 0 <= peer_index < self.group.size:
            raise UsageError(f"peer index {peer_index!r} is not a member of {self._where}: "
                             f"expected 0..{self.group.size - 1} (member order, not global rank)")
        return peer_index

    def _call(self, call: str, names: Sequence[str], fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            status = error_status(exc)
            last = self._last_error()
            msg = format_error(format_call(call, names, args), status, _error_text(self._mod, exc, status),
                               self._where, last)
            raise self._fail(msg) from exc

    def _fail(self, msg: str) -> DeviceError:
        """End any open NCCL group, abort the communicator; the error to raise."""
        while self._in_group:
            self._in_group -= 1
            with contextlib.suppress(Exception):
                self._mod.group_end()
        msg += self._abort_quietly()
        self._failure = msg
        return DeviceError(msg)

    def _abort_quietly(self) -> str:
        """comm_abort; what to append to the message."""
        self._state = "aborted"
        try:
            self._mod.comm_abort(self.comm)
        except Exception as exc:
            return f" (the communicator was aborted; ncclCommAbort itself failed: {exc})"
        return " (the communicator was aborted: every member must rejoin)"

    def _last_error(self) -> str:
        try:
            return str(self._mod.get_last_error(self.comm) or "")
        except Exception:
            return ""


# --- joining ---------------------------------------------------------------------------------------


def _check_joins(groups: Sequence[tuple[GroupInfo, bytes]]) -> None:
    seen: set[str] = set()
    for group, uid in groups:
        if group.name in seen:
            raise UsageError(f"NCCL group {group.name!r} is listed twice in one join")
        seen.add(group.name)
        if not 0 <= group.index < group.size:
            raise UsageError(f"{describe(group)}: this rank's index is outside the group")
        if not isinstance(uid, (bytes, bytearray)) or len(uid) != UNIQUE_ID_NBYTES:
            got = f"{len(uid)} bytes" if isinstance(uid, (bytes, bytearray)) else type(uid).__name__
            raise UsageError(f"{describe(group)}: NCCL unique id must be {UNIQUE_ID_NBYTES} bytes, got {got}"
                             " (it comes from member 0's offer)")


def join_all(groups: Sequence[tuple[GroupInfo, bytes]], stream: int, device: int) -> dict[str, NcclGroup]:
    """Join every group at once: ncclGroupStart, ncclCommInitRank per group (nranks = group size,
    rank = this rank's index), ncclGroupEnd. On any failure every communicator created is aborted
    and DeviceError names the groups. The CUDA context of `device` must be current (caller's job);
    each communicator's device is checked against `device`."""
    groups = list(groups)
    _check_joins(groups)
    if not groups:
        return {}
    mod = _nccl()
    names = ", ".join(f"{describe(g)} id {bytes(u)[:8].hex()}..." for g, u in groups)
    context = f"joining NCCL {names} on device {device}"
    raw = [bytes(u) for _, u in groups]  # UniqueId.from_buffer wraps this memory: keep it alive
    ids = [_run("UniqueId.from_buffer", (), mod.UniqueId.from_buffer, b) for b in raw]

    try:
        mod.group_start()
    except Exception as exc:
        status = error_status(exc)
        raise DeviceError(format_error("ncclGroupStart()", status, _error_text(mod, exc, status),
                                       context)) from exc
    comms: list[tuple[GroupInfo, Any]] = []
    failure: tuple[str, BaseException] | None = None
    call = "ncclCommInitRank"
    try:
        for (group, _), uid in zip(groups, ids):
            call = format_call("ncclCommInitRank", ("nranks", "rank"), (group.size, group.index))
            call += f" for {describe(group)}"
            comms.append((group, _as_comm(mod, mod.comm_init_rank(group.size, uid, group.index))))
    except Exception as exc:
        failure = (call, exc)
    try:
        mod.group_end()
    except Exception as exc:
        if failure is None:
            failure = ("ncclGroupEnd()", exc)

    detail = ""
    if failure is None:
        for group, comm in comms:
            try:
                on = int(mod.comm_cu_device(comm))
            except Exception as exc:
                failure = (f"ncclCommCuDevice for {describe(group)}", exc)
                break
            if on != device:
                detail = (f"{describe(group)}'s communicator is on CUDA device {on}, expected {device}: "
                          f"the CUDA context of device {device} was not current when joining")
                break
    if failure is None and not detail:
        return {group.name: NcclGroup(group, comm, stream, device) for group, comm in comms}

    if failure is not None:
        call, exc = failure
        status = error_status(exc)
        detail = format_error(call, status, _error_text(mod, exc, status))
    aborted = []
    for group, comm in comms:
        try:
            mod.comm_abort(comm)
            aborted.append(group.name)
        except Exception as exc:
            detail += f"; ncclCommAbort for {describe(group)} failed too: {exc}"
    tail = f"; aborted the communicators of {', '.join(aborted)}" if aborted else ""
    raise DeviceError(f"{context}: {detail}{tail}") from (failure[1] if failure else None)


# --- the collectives layer's joiner -----------------------------------------------------------------


class NcclJoiner(Joiner):
    """Joins NCCL groups for one cuda backend: member 0 offers a fresh unique id as the join info.

    `backend` needs `make_current()`, `stream_handle` (the rank's stream as an int) and `info.ordinal`.
    """

    crosses_nodes = True  # NCCL picks its transport: NVLink within a node, the network between

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def join_info(self, group: GroupInfo) -> bytes:
        return get_unique_id()

    def join(self, joins: Sequence[GroupJoin]) -> dict[str, Collectives]:
        """One NCCL group call for every group. HandshakeError when member 0 offered no unique id
        (e.g. its offer came from a host-backend rank); DeviceError when NCCL fails."""
        missing = [j.group.name for j in joins if len(j.join_info) != UNIQUE_ID_NBYTES]
        if missing:
            raise HandshakeError(
                f"no NCCL unique id for group(s) {', '.join(missing)}: member 0 of each group must offer "
                f"{UNIQUE_ID_NBYTES} bytes of join info (was its offer made by a host-backend rank?)"
            )
        self.backend.make_current()
        return dict(join_all([(j.group, j.join_info) for j in joins], self.backend.stream_handle,
                             self.backend.info.ordinal))

    def adopt(self, joins: Sequence[GroupJoin], joined: dict[str, Collectives]) -> dict[str, Collectives]:
        """Groups joined on the early join's thread get the rank's stream (they had 0 until now)."""
        for group in joined.values():
            assert isinstance(group, NcclGroup)
            if group.device != self.backend.info.ordinal:
                raise DeviceError(f"{group!r} was joined early on device {group.device}, but this rank's backend "
                                  f"is device {self.backend.info.ordinal}")
            group.stream = self.backend.stream_handle
        return dict(joined)


__all__ = [
    "NCCL_DTYPES",
    "NcclGroup",
    "NcclJoiner",
    "decode_version",
    "format_call",
    "format_error",
    "get_unique_id",
    "join_all",
    "nccl_dtype",
    "version",
]
