"""tray.collectives.nccl without a GPU or nccl4py: tables, messages, lazy import, and the call
sequences and abort-on-error rules, driven through a fake of `nccl.bindings.nccl`."""

from __future__ import annotations

import enum
import os
import pathlib
import subprocess
import sys
import threading
import time
import types
from typing import Any

import pytest

import tray.collectives.nccl as m
from tray.backend.base import GroupInfo
from tray.errors import DeviceError, UsageError

# --- a fake nccl.bindings.nccl ---------------------------------------------------------------------


class DataType(enum.IntEnum):
    Int8 = 0
    Uint8 = 1
    Int32 = 2
    Uint32 = 3
    Int64 = 4
    Uint64 = 5
    Float16 = 6
    Float32 = 7
    Float64 = 8
    Bfloat16 = 9


class RedOp(enum.IntEnum):
    Sum = 0


class NCCLError(Exception):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"status ({status})")


class Comm:
    def __init__(self, handle: int = 0) -> None:
        self.handle = handle

    def __repr__(self) -> str:
        return f"Comm({self.handle:#x})"


class UniqueId:
    def __init__(self, data: bytes) -> None:
        self.data = data

    @classmethod
    def from_buffer(cls, b: bytes) -> UniqueId:
        if len(b) != 128:
            raise ValueError("buffer length must be 128 bytes")
        return cls(b)


class FakeNccl:
    """Records every call as (name, args); `fail` maps a call name to the status it raises."""

    DataType = DataType
    RedOp = RedOp
    NCCLError = NCCLError
    Comm = Comm
    UniqueId = UniqueId

    def __init__(self, device: int = 0) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail: dict[str, int] = {}
        self.fail_after: dict[str, int] = {}  # name -> number of successful calls before failing
        self.device = device
        self.next_comm = 0x1000
        self.async_status = 0

    def _do(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        if name in self.fail_after:
            if self.fail_after[name] == 0:
                raise NCCLError(self.fail.get(name, 3))
            self.fail_after[name] -= 1
        elif name in self.fail:
            raise NCCLError(self.fail[name])

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def get_version(self) -> int:
        self._do("get_version")
        return 22809

    def get_unique_id(self) -> bytes:
        self._do("get_unique_id")
        return bytes(range(128))

    def get_error_string(self, status: int) -> str:
        return {1: "unhandled cuda error", 3: "internal error", 4: "invalid argument",
                6: "remote process exited or there was a network error"}.get(status, "unknown")

    def get_last_error(self, comm: Comm) -> str:
        return "AllReduce : invalid recvbuff" if self.calls and self.calls[-1][0] == "all_reduce" else ""

    def group_start(self) -> None:
        self._do("group_start")

    def group_end(self) -> None:
        self._do("group_end")

    def comm_init_rank(self, nranks: int, uid: UniqueId, rank: int) -> Comm:
        assert isinstance(uid, UniqueId)
        self._do("comm_init_rank", nranks, uid.data[:1], rank)
        self.next_comm += 0x10
        return Comm(self.next_comm)

    def comm_cu_device(self, comm: Comm) -> int:
        self._do("comm_cu_device", comm.handle)
        return self.device

    def comm_destroy(self, comm: Comm) -> None:
        self._do("comm_destroy", comm.handle)

    def comm_abort(self, comm: Comm) -> None:
        self._do("comm_abort", comm.handle)

    def comm_window_register(self, comm: Comm, buff: int, size: int, flags: int) -> int:
        self._do("comm_window_register", comm.handle, buff, size, flags)
        return 0x7000 + buff

    def comm_window_deregister(self, comm: Comm, win: int) -> None:
        self._do("comm_window_deregister", comm.handle, win)

    def comm_get_async_error(self, comm: Comm) -> int:
        self._do("comm_get_async_error", comm.handle)
        return self.async_status

    def all_reduce(self, s: int, r: int, count: int, dt: int, op: int, comm: Comm, stream: int) -> None:
        assert isinstance(comm, Comm)
        self._do("all_reduce", s, r, count, dt, op, comm.handle, stream)

    def all_gather(self, s: int, r: int, count: int, dt: int, comm: Comm, stream: int) -> None:
        self._do("all_gather", s, r, count, dt, comm.handle, stream)

    def reduce_scatter(self, s: int, r: int, count: int, dt: int, op: int, comm: Comm, stream: int) -> None:
        self._do("reduce_scatter", s, r, count, dt, op, comm.handle, stream)

    def send(self, s: int, count: int, dt: int, peer: int, comm: Comm, stream: int) -> None:
        self._do("send", s, count, dt, peer, comm.handle, stream)

    def recv(self, r: int, count: int, dt: int, peer: int, comm: Comm, stream: int) -> None:
        self._do("recv", r, count, dt, peer, comm.handle, stream)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNccl:
    f = FakeNccl()
    monkeypatch.setattr(m, "_bindings", f)
    return f


WORLD = GroupInfo("world", (0, 1, 2, 3), 1)
TP = GroupInfo("tp0", (0, 1), 1)
UID = bytes(range(128))
STREAM = 0x5000


def group(fake: FakeNccl, info: GroupInfo = WORLD) -> m.NcclGroup:
    return m.NcclGroup(info, Comm(0xC0), STREAM, 1)


# --- pure tables and messages ----------------------------------------------------------------------


def test_dtype_values_are_nccl_h() -> None:
    expected = {"i8": 0, "u8": 1, "i32": 2, "u32": 3, "i64": 4, "u64": 5, "f16": 6, "f32": 7, "f64": 8,
                "bf16": 9}
    assert {name: m.nccl_dtype(name) for name in expected} == expected
    for name, (value, member) in m.NCCL_DTYPES.items():
        assert DataType[member] == value, name


@pytest.mark.parametrize("bad", ["u16", "i16", "f8", "float32", "", None])
def test_dtype_refused(bad: Any) -> None:
    with pytest.raises(UsageError) as info:
        m.nccl_dtype(bad)
    assert "u8 i8 i32 u32 i64 u64 f16 bf16 f32 f64" in str(info.value)
    if bad in ("u16", "i16"):
        assert "16-bit integer" in str(info.value)


def test_check_enums() -> None:
    m.check_enums(FakeNccl())

    class Shifted(FakeNccl):
        DataType = enum.IntEnum("DataType", {"Int8": 0, "Uint8": 1, "Bfloat16": 10})  # type: ignore[misc]

    with pytest.raises(DeviceError, match=r"bf16: DataType.Bfloat16 = 10, expected 9"):
        m.check_enums(Shifted())


@pytest.mark.parametrize("code,text", [(22809, "2.28.9"), (23203, "2.32.3"), (2708, "2.7.8"),
                                       (21903, "2.19.3")])
def test_decode_version(code: int, text: str) -> None:
    assert m.decode_version(code) == text


def test_format_call() -> None:
    text = m.format_call("ncclAllReduce", m._ALLREDUCE, (0x7F00, 0x7F80, 16, 9, 0, Comm(1), 0x10))
    assert text == ("ncclAllReduce(sendbuff=0x7f00, recvbuff=0x7f80, count=16, datatype=bf16, op=sum, "
                    "stream=0x10)")
    assert m.format_call("ncclGroupEnd", (), ()) == "ncclGroupEnd()"


def test_format_error() -> None:
    msg = m.format_error("ncclSend(count=4)", 6, "remote process exited", "group 'ep' (member 0 of 2)",
                         "peer 1 gone")
    assert msg.startswith("ncclSend(count=4) in group 'ep' (member 0 of 2): ncclRemoteError: "
                          "remote process exited; NCCL's last error: peer 1 gone; a peer rank failed")
    assert "NCCL_DEBUG=INFO" in msg
    assert "ncclResult 42" in m.format_error("ncclX()", 42, "?")
    plain = m.format_error("ncclX()", None, "TypeError: no")
    assert plain.startswith("ncclX(): TypeError: no")
    # NCCL's own text already says which NCCL_DEBUG to use; not said twice
    assert m.format_error("x", 4, "invalid argument (run with NCCL_DEBUG=WARN for details)").count(
        "NCCL_DEBUG") == 1


# --- lazy import ---------------------------------------------------------------------------------


def test_import_needs_no_nccl() -> None:
    code = (
        "import sys; sys.modules['nccl'] = None\n"
        "import tray.collectives.nccl as m\n"
        "from tray.errors import DeviceError\n"
        "assert m.nccl_dtype('bf16') == 9\n"
        "try:\n    m.version()\nexcept DeviceError as e:\n    print(e)\nelse:\n    raise SystemExit('no error')\n"
    )
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert "nccl4py" in out.stdout and "scripts/gpu-wheels.sh install" in out.stdout


def test_missing_nccl_is_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nccl", None)
    monkeypatch.setattr(m, "_bindings", None)
    for call in (m.version, m.get_unique_id):
        with pytest.raises(DeviceError, match="NCCL is not available"):
            call()
    with pytest.raises(DeviceError, match="NCCL is not available"):
        m.join_all([(WORLD, UID)], STREAM, 1)


# --- module functions over the fake ----------------------------------------------------------------


def test_version_and_unique_id(fake: FakeNccl) -> None:
    assert m.version() == "2.28.9"
    assert m.get_unique_id() == bytes(range(128))
    fake.fail["get_version"] = 1
    with pytest.raises(DeviceError, match=r"ncclGetVersion\(\): ncclUnhandledCudaError: unhandled cuda"):
        m.version()


# --- NcclGroup -------------------------------------------------------------------------------------


def test_collectives_call_the_bindings(fake: FakeNccl) -> None:
    g = group(fake)
    g.allreduce(0x100, 0x200, 8, "bf16")
    g.allgather(0x100, 0x200, 8, "f32")
    g.reducescatter(0x100, 0x200, 8, "i32")
    g.send(0x100, 3, "u8", 2)
    g.recv(0x200, 3, "u8", 0)
    assert fake.calls == [
        ("all_reduce", (0x100, 0x200, 8, 9, 0, 0xC0, STREAM)),
        ("all_gather", (0x100, 0x200, 8, 7, 0xC0, STREAM)),
        ("reduce_scatter", (0x100, 0x200, 8, 2, 0, 0xC0, STREAM)),
        ("send", (0x100, 3, 1, 2, 0xC0, STREAM)),
        ("recv", (0x200, 3, 1, 0, 0xC0, STREAM)),
    ]


def test_alltoall_is_one_group_of_sends_and_recvs(fake: FakeNccl) -> None:
    group(fake).alltoall(0x1000, 0x9000, 5, "bf16")  # chunk 10 bytes
    assert fake.calls[0] == ("group_start", ())
    assert fake.calls[-1] == ("group_end", ())
    body = fake.calls[1:-1]
    assert body == [call for peer in range(4) for call in (
        ("send", (0x1000 + 10 * peer, 5, 9, peer, 0xC0, STREAM)),
        ("recv", (0x9000 + 10 * peer, 5, 9, peer, 0xC0, STREAM)),
    )]


def test_failure_aborts_and_refuses_later_calls(fake: FakeNccl) -> None:
    g = group(fake)
    fake.fail["all_reduce"] = 4
    with pytest.raises(DeviceError) as info:
        g.allreduce(0x100, 0x200, 8, "f16")
    msg = str(info.value)
    assert "ncclAllReduce(sendbuff=0x100, recvbuff=0x200, count=8, datatype=f16, op=sum, stream=0x5000)" in msg
    assert "group 'world' (member 1 of 4, ranks (0, 1, 2, 3)) on device 1" in msg
    assert "ncclInvalidArgument: invalid argument" in msg
    assert "AllReduce : invalid recvbuff" in msg
    assert "aborted" in msg
    assert fake.names()[-1] == "comm_abort"
    with pytest.raises(DeviceError, match="aborted after ncclAllReduce"):
        g.allgather(0x100, 0x200, 8, "f16")
    n = len(fake.calls)
    g.close()  # no destroy after an abort
    g.abort()
    assert len(fake.calls) == n


def test_failure_inside_alltoall_ends_the_group_then_aborts(fake: FakeNccl) -> None:
    fake.fail["recv"] = 6
    fake.fail_after["recv"] = 2
    g = group(fake)
    with pytest.raises(DeviceError, match=r"ncclRecv\(recvbuff=0x9014, count=5, datatype=bf16, peer=2"):
        g.alltoall(0x1000, 0x9000, 5, "bf16")
    assert fake.names()[-2:] == ["group_end", "comm_abort"]
    assert fake.names().count("group_end") == 1


def test_group_end_failure_aborts(fake: FakeNccl) -> None:
    fake.fail["group_end"] = 5
    g = group(fake)
    with pytest.raises(DeviceError, match="ncclGroupEnd.*ncclInvalidUsage"):
        g.alltoall(0x1000, 0x9000, 5, "u8")
    assert fake.names()[-2:] == ["group_end", "comm_abort"]


def test_exception_inside_batch_aborts(fake: FakeNccl) -> None:
    g = group(fake)
    with pytest.raises(RuntimeError), g.batch():
        g.send(0x100, 1, "u8", 0)
        raise RuntimeError("caller's bug")
    assert fake.names() == ["group_start", "send", "group_end", "comm_abort"]
    with pytest.raises(DeviceError, match="exception inside batch"):
        g.recv(0x100, 1, "u8", 0)


def test_batch_pairs_send_and_recv(fake: FakeNccl) -> None:
    g = group(fake, TP)
    with g.batch():
        g.send(0x100, 2, "f64", 0)
        g.recv(0x200, 2, "f64", 0)
    assert fake.names() == ["group_start", "send", "recv", "group_end"]


def test_usage_errors_do_not_abort(fake: FakeNccl) -> None:
    g = group(fake)
    with pytest.raises(UsageError, match="peer index 4 is not a member"):
        g.send(0x100, 1, "u8", 4)
    with pytest.raises(UsageError, match="dtype"):
        g.allreduce(0x100, 0x200, 1, "u16")
    with pytest.raises(UsageError):
        g.alltoall(0x100, 0x200, 1, "i16")
    assert fake.calls == []
    g.allreduce(0x100, 0x200, 1, "u8")  # still usable


def test_close_is_idempotent(fake: FakeNccl) -> None:
    g = group(fake)
    g.close()
    g.close()
    g.abort()
    assert fake.names() == ["comm_destroy"]
    with pytest.raises(UsageError, match="after close"):
        g.allreduce(0x100, 0x200, 1, "u8")


def test_close_failure_aborts(fake: FakeNccl) -> None:
    fake.fail["comm_destroy"] = 3
    g = group(fake)
    with pytest.raises(DeviceError, match="ncclCommDestroy.*ncclInternalError.*aborted"):
        g.close()
    assert fake.names() == ["comm_destroy", "comm_abort"]
    g.close()


def test_windows_are_symmetric_and_go_before_the_destroy(fake: FakeNccl) -> None:
    g = group(fake)
    g.register_window(0x100, 4096)
    g.register_window(0x200, 4096)
    assert fake.calls == [("comm_window_register", (0xC0, 0x100, 4096, 1)),
                          ("comm_window_register", (0xC0, 0x200, 4096, 1))]  # NCCL_WIN_COLL_SYMMETRIC
    with pytest.raises(UsageError, match="0 bytes"):
        g.register_window(0x300, 0)
    g.close()
    assert fake.names()[2:] == ["comm_window_deregister", "comm_window_deregister", "comm_destroy"]
    assert [args[1] for name, args in fake.calls if name == "comm_window_deregister"] == [0x7100, 0x7200]


def test_a_failed_window_registration_aborts(fake: FakeNccl) -> None:
    fake.fail["comm_window_register"] = 4
    g = group(fake)
    with pytest.raises(DeviceError, match="ncclCommWindowRegister.*ncclInvalidArgument.*aborted"):
        g.register_window(0x100, 4096)
    assert fake.names() == ["comm_window_register", "comm_abort"]


def test_an_nccl_without_windows_says_so(fake: FakeNccl, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(FakeNccl, "comm_window_register")
    with pytest.raises(UsageError, match="has no windows.*2.27"):
        group(fake).register_window(0x100, 4096)


def test_abort(fake: FakeNccl) -> None:
    g = group(fake)
    g.abort()
    g.abort()
    assert fake.names() == ["comm_abort"]
    with pytest.raises(DeviceError, match="abort\\(\\) was called"):
        g.reducescatter(0x100, 0x200, 1, "u8")


def test_check_async_error(fake: FakeNccl) -> None:
    g = group(fake)
    g.check()
    fake.async_status = 7  # in progress is not an error
    g.check()
    fake.async_status = 6
    with pytest.raises(DeviceError, match="ncclCommGetAsyncError.*ncclRemoteError.*a peer rank failed"):
        g.check()
    assert fake.names()[-1] == "comm_abort"


# --- join_all --------------------------------------------------------------------------------------


def test_join_all(fake: FakeNccl) -> None:
    fake.device = 1
    other = bytes([7]) + bytes(127)
    groups = m.join_all([(WORLD, UID), (TP, other)], STREAM, 1)
    assert list(groups) == ["world", "tp0"]
    assert fake.names() == ["group_start", "comm_init_rank", "comm_init_rank", "group_end",
                            "comm_cu_device", "comm_cu_device"]
    assert fake.calls[1] == ("comm_init_rank", (4, b"\x00", 1))
    assert fake.calls[2] == ("comm_init_rank", (2, b"\x07", 1))
    world = groups["world"]
    assert world.group == WORLD and world.stream == STREAM and isinstance(world.comm, Comm)
    world.allreduce(0, 0, 1, "f32")
    assert fake.calls[-1][1][5] == world.comm.handle
    assert m.join_all([], STREAM, 1) == {}


def test_join_all_failure_aborts_created(fake: FakeNccl) -> None:
    fake.device = 1
    fake.fail["comm_init_rank"] = 1
    fake.fail_after["comm_init_rank"] = 1
    with pytest.raises(DeviceError) as info:
        m.join_all([(WORLD, UID), (TP, UID)], STREAM, 1)
    msg = str(info.value)
    assert msg.startswith("joining NCCL group 'world' (member 1 of 4, ranks (0, 1, 2, 3)) id 0001020304050607")
    assert "ncclCommInitRank(nranks=2, rank=1) for group 'tp0'" in msg
    assert "ncclUnhandledCudaError" in msg and "aborted the communicators of world" in msg
    assert fake.names() == ["group_start", "comm_init_rank", "comm_init_rank", "group_end", "comm_abort"]


def test_join_all_group_end_failure(fake: FakeNccl) -> None:
    fake.device = 1
    fake.fail["group_end"] = 6
    with pytest.raises(DeviceError, match="ncclGroupEnd.*ncclRemoteError.*aborted the communicators of "
                                          "world, tp0"):
        m.join_all([(WORLD, UID), (TP, UID)], STREAM, 1)
    assert fake.names()[-2:] == ["comm_abort", "comm_abort"]


def test_join_all_wrong_device(fake: FakeNccl) -> None:
    fake.device = 0
    with pytest.raises(DeviceError, match="on CUDA device 0, expected 1: the CUDA context of device 1"):
        m.join_all([(WORLD, UID)], STREAM, 1)
    assert fake.names()[-1] == "comm_abort"


@pytest.mark.parametrize("joins,match", [
    ([(WORLD, UID), (WORLD, UID)], "listed twice"),
    ([(WORLD, UID[:64])], "must be 128 bytes, got 64 bytes"),
    ([(WORLD, "x" * 128)], "got str"),
    ([(GroupInfo("g", (0, 1), 2), UID)], "index is outside"),
])
def test_join_all_refuses(fake: FakeNccl, joins: Any, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        m.join_all(joins, STREAM, 1)
    assert fake.calls == []


# --- the collectives layer's joiner ----------------------------------------------------------------


class FakeCudaBackend:
    """What NcclJoiner uses of a CudaBackend: its name, stream, device ordinal and context."""

    name = "cuda"

    def __init__(self, ordinal: int = 1) -> None:
        self.stream_handle = STREAM
        self.info = types.SimpleNamespace(ordinal=ordinal)
        self.made_current = 0

    def make_current(self) -> None:
        self.made_current += 1


def test_joiner_offers_a_unique_id_and_joins_with_member_0s(fake: FakeNccl) -> None:
    from tray.collectives import GroupJoin, for_backend

    fake.device = 1
    backend = FakeCudaBackend()
    joiner = for_backend(backend)
    assert isinstance(joiner, m.NcclJoiner)
    assert joiner.buffer_nbytes(WORLD, 1 << 30) == 0  # NCCL needs no exported working buffer
    info = joiner.join_info(GroupInfo("world", (0, 1, 2, 3), 0))
    assert info == UID and fake.names() == ["get_unique_id"]
    other = bytes([9]) + bytes(127)
    groups = joiner.join([GroupJoin(WORLD, info, barrier=None), GroupJoin(TP, other, barrier=None)])
    assert list(groups) == ["world", "tp0"] and backend.made_current == 1
    assert fake.calls[2] == ("comm_init_rank", (4, b"\x00", 1))
    assert fake.calls[3] == ("comm_init_rank", (2, b"\x09", 1))
    assert all(isinstance(g, m.NcclGroup) and g.stream == STREAM and g.device == 1 for g in groups.values())


@pytest.mark.parametrize("info", [b"", bytes(64)])
def test_joiner_refuses_join_info_that_is_no_unique_id(fake: FakeNccl, info: bytes) -> None:
    from tray.collectives import GroupJoin
    from tray.errors import HandshakeError

    joiner = m.NcclJoiner(FakeCudaBackend())
    with pytest.raises(HandshakeError, match=r"no NCCL unique id for group\(s\) tp0: member 0 of each group "
                                             r"must offer 128 bytes of join info"):
        joiner.join([GroupJoin(WORLD, UID, barrier=None), GroupJoin(TP, info, barrier=None)])
    assert fake.calls == []


def test_host_joiner_needs_no_join_info_and_a_page_rounded_buffer() -> None:
    from tray.backend.host import PAGE_NBYTES, HostBackend
    from tray.collectives import GroupJoin, for_backend
    from tray.collectives.host import HostJoiner

    backend = HostBackend.open(0)
    try:
        joiner = for_backend(backend)
        assert isinstance(joiner, HostJoiner) and joiner.join_info(WORLD) == b""
        assert joiner.buffer_nbytes(WORLD, 1) == PAGE_NBYTES
        assert joiner.buffer_nbytes(WORLD, PAGE_NBYTES + 1) == 2 * PAGE_NBYTES
        with pytest.raises(UsageError, match="host collectives need a scratch buffer"):
            joiner.join([GroupJoin(WORLD, b"", barrier=None)])
    finally:
        backend.close()


def test_unknown_backend_has_no_collectives() -> None:
    from tray.collectives import for_backend

    with pytest.raises(UsageError, match="backend 'rocm' has no collectives"):
        for_backend(types.SimpleNamespace(name="rocm"))


def test_close_that_never_returns_is_bounded_and_names_the_graphs(fake: FakeNccl,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # ncclCommDestroy waits for every CUDA graph that captured the communicator: a live one must not hang close
    release = threading.Event()
    monkeypatch.setattr(fake, "comm_destroy", lambda comm: release.wait(10))
    monkeypatch.setenv("TRAY_NCCL_CLOSE_TIMEOUT_S", "0.6")
    g = group(fake)
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"within 0.6 s: .*every CUDA graph that captured .*del graph"):
        g.close()
    assert 0.6 <= time.monotonic() - t0 < 5
    release.set()
    g.close()  # closed: nothing more to wait for
    with pytest.raises(UsageError, match="after close"):
        g.allreduce(0x100, 0x200, 1, "u8")


def test_close_timeout_must_be_positive(fake: FakeNccl, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAY_NCCL_CLOSE_TIMEOUT_S", "0")
    g = group(fake)
    with pytest.raises(UsageError, match="TRAY_NCCL_CLOSE_TIMEOUT_S must be a positive number.*'0'"):
        g.close()
    monkeypatch.delenv("TRAY_NCCL_CLOSE_TIMEOUT_S")
    g.close()  # still open after the refusal: destroyed now
    assert fake.names() == ["comm_destroy"]
