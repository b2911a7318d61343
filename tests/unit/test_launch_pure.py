"""The prepared launch paths without a GPU: libcuda's entry points replaced by ctypes callbacks (what C
receives, and how a bad status becomes a named CudaError), and the barrier's choice between a
one-barrier graph and a kernel launch, over a fake driver."""

from __future__ import annotations

import ctypes
import json
from types import SimpleNamespace
from typing import Any

import pytest

from tray.backend.base import GroupInfo
from tray.backend.cuda import barrier as barrier_mod
from tray.backend.cuda import driver
from tray.backend.cuda.barrier import CudaBarrier, OwnCapture, launch_mode
from tray.errors import BarrierTimeout, UsageError

ILLEGAL_ADDRESS = 700  # CUDA_ERROR_ILLEGAL_ADDRESS in cuda.h
REAL_GRAPH_LAUNCHER = driver.graph_launcher  # the fake driver below replaces it; one test wants it back


def expected_code(status: int, name: str) -> str:
    """The code CudaError carries: the enum's name when the bindings are installed, else the number."""
    return name if driver.cu is not None else str(status)


@pytest.fixture
def symbols(monkeypatch) -> dict[str, Any]:
    """libcuda's symbols, filled per test with ctypes callbacks (kept alive by the dict)."""
    table: dict[str, Any] = {}
    monkeypatch.setattr(driver, "_symbols", table)
    return table


def test_prepared_passes_its_arguments_and_names_a_failure(symbols) -> None:
    seen: list[tuple[int, int]] = []
    status = [0]

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    def fake(graph_exec: int, stream: int) -> int:
        seen.append((graph_exec, stream))
        return status[0]

    symbols["cuGraphLaunch"] = fake
    launch = driver.graph_launcher(0xABC, 0xDEF)
    launch()
    launch()
    assert seen == [(0xABC, 0xDEF)] * 2
    status[0] = ILLEGAL_ADDRESS
    with pytest.raises(driver.CudaError) as info:
        launch()
    err = info.value
    assert err.call == "cuGraphLaunch"
    assert err.code == expected_code(ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS")
    assert "stream 0xdef" in str(err)


def test_event_recorder_records_on_its_stream(symbols) -> None:
    seen: list[tuple[int, int]] = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    def fake(event: int, stream: int) -> int:
        seen.append((event, stream))
        return 0

    symbols["cuEventRecord"] = fake
    driver.event_recorder(0x10, 0x20)()
    assert seen == [(0x10, 0x20)]


def test_launcher_plain_passes_dims_stream_and_params(symbols) -> None:
    seen: list[tuple[int, ...]] = []
    uint = ctypes.c_uint

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, uint, uint, uint, uint, uint, uint, uint, ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_void_p)
    def fake(func, gx, gy, gz, bx, by, bz, shmem, stream, params, extra) -> int:
        seen.append((func, gx, gy, gz, bx, by, bz, shmem, stream, params, extra))
        return 0

    symbols["cuLaunchKernel"] = fake
    driver.launcher(0x77, (3, 2, 1), (128, 1, 1), 64, 0x55, 0x9000, "k")()
    assert seen == [(0x77, 3, 2, 1, 128, 1, 1, 64, 0x55, 0x9000, None)]


def test_launcher_programmatic_passes_a_config_with_the_attribute(symbols) -> None:
    seen: list[tuple[int, ...]] = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    def fake(config_addr, func, params, extra) -> int:
        config = driver._LaunchConfig.from_address(config_addr)
        attr = config.attrs[0]
        seen.append((func, params, config.gridDimX, config.blockDimX, config.sharedMemBytes, config.hStream,
                     config.numAttrs, attr.id, attr.value[0]))
        return 1  # CUDA_ERROR_INVALID_VALUE

    symbols["cuLaunchKernelEx"] = fake
    launch = driver.launcher(0x77, (1, 1, 1), (32, 1, 1), 0, 0x55, 0x9000, "tray_peer_barrier", programmatic=True)
    with pytest.raises(driver.CudaError) as info:
        launch()
    assert seen == [(0x77, 0x9000, 1, 32, 0, 0x55, 1, 5, 1)]
    assert info.value.call == "cuLaunchKernelEx"
    assert "tray_peer_barrier, grid (1, 1, 1), block (32, 1, 1)" in str(info.value)


def test_symbol_missing_is_a_named_error(monkeypatch, symbols) -> None:
    monkeypatch.setattr(driver, "_libcuda", lambda: SimpleNamespace())
    with pytest.raises(driver.CudaError, match="LIBRARY_NOT_FOUND") as info:
        driver.symbol("cuGraphLaunch")
    assert info.value.call == "cuGraphLaunch"


def test_launch_mode() -> None:
    assert launch_mode(None) == launch_mode("") == launch_mode(" Graph ") == "graph"
    assert launch_mode("kernel") == "kernel"
    with pytest.raises(UsageError, match="TRAY_BARRIER_LAUNCH must be one of graph, kernel, got 'fast'"):
        launch_mode("fast")


# --- the barrier over a fake driver -------------------------------------------------------------------


class FakeStream:
    """What the fake driver knows of the rank's stream: whether a capture runs, and what was enqueued."""

    def __init__(self) -> None:
        self.capturing = False
        self.captured: list[str] = []
        self.ran: list[str] = []
        self.graphs_destroyed = 0
        self.execs_destroyed = 0


class FakeLaunch:
    def __init__(self, stream: FakeStream, tag: str) -> None:
        self.stream, self.tag = stream, tag

    def launch(self) -> None:
        (self.stream.captured if self.stream.capturing else self.stream.ran).append(self.tag)


class FakeKernel:
    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.binds: list[tuple[Any, ...]] = []

    def bind(self, grid, block, args, programmatic=False, stream=None) -> FakeLaunch:
        self.binds.append((tuple(args), stream))
        return FakeLaunch(self.stream, f"kernel(timeout_ns={args[-1]}, stream={stream})")


@pytest.fixture
def fake(monkeypatch):
    """A CudaBarrier of two members on a fake driver; yields (barrier, stream, kernel, own_capture)."""
    drv = barrier_mod.drv
    stream = FakeStream()
    host_word = ctypes.c_uint32(0)
    graphs: list[list[str]] = []

    def end_capture(_s):
        stream.capturing = False
        graphs.append(list(stream.captured))
        stream.captured.clear()
        return len(graphs) - 1

    def graph_launcher(graph_exec, _s):
        return lambda: stream.ran.append(f"graph{graph_exec}: " + ", ".join(graphs[graph_exec]))

    for name, fn in {
        "mem_alloc": lambda nbytes: 0x1000,
        "memset_d8_async": lambda *a: None,
        "stream_synchronize": lambda s: None,
        "mem_host_alloc_mapped": lambda nbytes: (ctypes.addressof(host_word), 0x2000),
        "mem_free": lambda p: None,
        "mem_free_host": lambda p: None,
        "as_stream": lambda handle: f"caller{handle}",
        "stream_is_capturing": lambda s: stream.capturing,
        "stream_begin_capture": lambda s: setattr(stream, "capturing", True),
        "stream_end_capture": end_capture,
        "graph_instantiate": lambda g: g,
        "graph_launcher": graph_launcher,
        "graph_exec_destroy": lambda e: setattr(stream, "execs_destroyed", stream.execs_destroyed + 1),
        "graph_destroy": lambda g: setattr(stream, "graphs_destroyed", stream.graphs_destroyed + 1),
    }.items():
        monkeypatch.setattr(drv, name, fn)
    monkeypatch.delenv("TRAY_BARRIER_LAUNCH", raising=False)
    kernel = FakeKernel(stream)
    own = OwnCapture()
    flags = SimpleNamespace(ptr=0x3000, nbytes=16)
    table = SimpleNamespace(ptr=0x4000, ptrs=[0x3000, 0x5000])
    barrier = CudaBarrier(GroupInfo("world", (0, 1), 0), flags, table, kernel, "rank-stream", programmatic=True,
                          own_capture=own)
    yield barrier, stream, kernel, own
    barrier.close()


def test_eager_launches_replay_one_graph_per_timeout(fake) -> None:
    barrier, stream, kernel, _own = fake
    assert barrier.mode == "graph"
    for _ in range(3):
        barrier.launch(2.0)
    barrier.launch(0.5)
    assert stream.ran == ["graph0: kernel(timeout_ns=2000000000, stream=rank-stream)"] * 3 + [
        "graph1: kernel(timeout_ns=500000000, stream=rank-stream)"]
    assert len(kernel.binds) == 2, "arguments are packed once per timeout"
    barrier.close()
    assert (stream.graphs_destroyed, stream.execs_destroyed) == (2, 2)
    with pytest.raises(UsageError, match=r"the barrier of group .world.: used after close\(\) of its rank"):
        barrier.launch(2.0)


def test_launches_during_the_backends_capture_are_kernel_launches(fake) -> None:
    barrier, stream, _kernel, own = fake
    own.active = True
    stream.capturing = True
    barrier.launch(2.0)
    assert stream.captured == ["kernel(timeout_ns=2000000000, stream=rank-stream)"]
    assert stream.ran == []
    own.active = stream.capturing = False
    stream.captured.clear()
    barrier.launch(2.0)  # the same timeout eagerly: now through a graph, its kernel launch reused
    assert stream.ran == ["graph0: kernel(timeout_ns=2000000000, stream=rank-stream)"]


def test_a_callers_stream_and_kernel_mode_launch_the_kernel(fake, monkeypatch) -> None:
    barrier, stream, _kernel, _own = fake
    barrier.launch(2.0, stream=7)
    barrier.mode = "kernel"
    barrier.launch(2.0)
    barrier.launch_kernel(1.0)
    assert stream.ran == ["kernel(timeout_ns=2000000000, stream=caller7)",
                          "kernel(timeout_ns=2000000000, stream=rank-stream)",
                          "kernel(timeout_ns=1000000000, stream=rank-stream)"]
    monkeypatch.setenv("TRAY_BARRIER_LAUNCH", "nope")
    with pytest.raises(UsageError, match="TRAY_BARRIER_LAUNCH"):
        CudaBarrier(barrier.group, barrier._flags, barrier._peer_flags, FakeKernel(stream), "s")


def test_a_foreign_capture_of_the_rank_stream_is_refused_by_name(fake) -> None:
    barrier, stream, _kernel, _own = fake
    stream.capturing = True  # someone else captures the rank's stream: a graph launch must not be recorded
    with pytest.raises(UsageError, match=r"barrier world: the rank's stream is being captured outside"):
        barrier.launch(2.0)
    assert stream.captured == [] and stream.ran == []


def test_a_bad_timeout_is_refused_before_any_capture(fake) -> None:
    barrier, stream, _kernel, _own = fake
    with pytest.raises(UsageError, match="timeout_s must be > 0, got 0"):
        barrier.launch(0)
    assert not stream.capturing and stream.graphs_destroyed == 0


def test_the_host_barrier_refuses_a_bad_timeout_as_cuda_does() -> None:
    import numpy as np

    from tray.backend.host.barrier import HostBarrier

    flags = np.zeros(2, np.uint64)
    barrier = HostBarrier(GroupInfo("world", (0, 1), 0), flags.ctypes.data, [flags.ctypes.data] * 2)
    for bad in (0, -1.0):
        with pytest.raises(UsageError, match=f"barrier world: timeout_s must be > 0, got {bad}"):
            barrier.launch(bad)
    assert barrier.epoch == 0 and not flags.any()
    barrier.check()  # refused, not broken


def test_a_host_barrier_whose_last_member_arrives_as_its_wait_runs_out_passes(monkeypatch) -> None:
    """The last member's flag landed between the wait's final poll and the count of who was missing: the barrier
    raised a BarrierTimeout that named no missing rank (its peers, which saw every flag, went on), and the head
    took it for the root cause. Every member arrived: the barrier passes."""
    import numpy as np

    from tray.backend.host import barrier as host_barrier

    flags = np.zeros(2, np.uint64)
    barrier = host_barrier.HostBarrier(GroupInfo("world", (0, 1), 0), flags.ctypes.data, [flags.ctypes.data] * 2)
    real = host_barrier.spin_until

    def peer_arrives_after_the_last_poll(done, timeout_s):
        waited = real(done, timeout_s)
        flags[1] = barrier.epoch
        return waited

    monkeypatch.setattr(host_barrier, "spin_until", peer_arrives_after_the_last_poll)
    barrier.launch(0.01)
    barrier.check()
    monkeypatch.setattr(host_barrier, "spin_until", real)
    with pytest.raises(BarrierTimeout, match="for rank 1"):  # a member that does not come is still named
        barrier.launch(0.01)


def test_a_failed_graph_launch_is_a_named_error(fake, monkeypatch, symbols) -> None:
    barrier, _stream, _kernel, _own = fake

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    def refuse(graph_exec: int, stream: int) -> int:
        return ILLEGAL_ADDRESS

    symbols["cuGraphLaunch"] = refuse
    monkeypatch.setattr(barrier_mod.drv, "graph_launcher", lambda e, _s: REAL_GRAPH_LAUNCHER(e, 0x99))
    with pytest.raises(driver.CudaError) as info:
        barrier.launch(2.0)
    assert info.value.call == "cuGraphLaunch"
    assert info.value.code == expected_code(ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS")
    assert "stream 0x99" in str(info.value)


# --- when the backend tells its barriers that the rank's stream may be recording -----------------------


@pytest.fixture
def fake_backend(monkeypatch):
    """A CudaBackend over a fake driver (no device): enough for capture() and joined()."""
    from tray.backend.base import DeviceInfo
    from tray.backend.cuda.backend import CudaBackend

    drv = barrier_mod.drv
    for name, fn in {"ctx_set_current": lambda ctx, ordinal: None, "event_record": lambda e, s: None,
                     "stream_wait_event": lambda s, e: None, "as_stream": lambda h: h,
                     "stream_begin_capture": lambda s: None, "stream_end_capture": lambda s: "graph",
                     "graph_instantiate": lambda g: 0x1, "graph_launcher": lambda e, s: (lambda: None),
                     "graph_destroy": lambda g: None}.items():
        monkeypatch.setattr(drv, name, fn)
    backend = CudaBackend(DeviceInfo(0, "GPU-0", "0000:00:00.0", -1), 0, None, 0x55, (9, 0))
    backend._order_events = ("into", "back")
    return backend


def test_capture_and_joined_mark_the_rank_stream_as_recording(fake_backend) -> None:
    seen: list[bool] = []
    flag = fake_backend._own_capture
    fake_backend.capture(lambda: seen.append(flag.active))
    with fake_backend.joined(0x99):
        seen.append(flag.active)
        fake_backend.capture(lambda: seen.append(flag.active))
        seen.append(flag.active)  # still joined after the inner capture ended
    with fake_backend.joined(None):  # no caller stream: nothing joins, nothing records
        seen.append(flag.active)
    assert seen == [True, True, True, True, False]
    assert not flag.active


def test_a_body_that_raises_clears_the_recording_mark(fake_backend) -> None:
    def boom() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fake_backend.capture(boom)
    with pytest.raises(RuntimeError, match="boom"), fake_backend.joined(0x99):
        boom()
    assert not fake_backend._own_capture.active


def test_a_watchdog_that_exited_stops_the_tray_naming_it() -> None:
    """A watchdog whose interpreter could not start (it died at once) left a killed head's ranks behind, the tray
    running on as if guarded; now the head's loop sees it gone and stops the tray."""
    from tray.launch.head import Head
    from tray.launch.spec import EXIT_HANDSHAKE, TraySpec

    head = Head(TraySpec(nprocs=1, cmd=("true",), backend="host"))
    head._check_watchdog()  # none yet: nothing to judge
    assert head.failure is None
    alive = SimpleNamespace(popen=SimpleNamespace(pid=4242, poll=lambda: None))
    head._watchdog = alive  # type: ignore[assignment]
    head._check_watchdog()
    assert head.failure is None
    head._watchdog = SimpleNamespace(popen=SimpleNamespace(pid=4242, poll=lambda: 1))  # type: ignore[assignment]
    head._check_watchdog()
    assert head.failure is not None and head.failure.exit_code == EXIT_HANDSHAKE
    assert head.failure.summary.startswith("the tray's watchdog (pid 4242, ") and "exited with code 1" in \
        head.failure.summary
    assert "its stderr, above, says why it ended" in head.failure.summary
    # killed by a signal: said as such (it was "exited with code -9", pointing at a stderr that says nothing)
    head = Head(TraySpec(nprocs=1, cmd=("true",), backend="host"))
    head._watchdog = SimpleNamespace(popen=SimpleNamespace(pid=4242, poll=lambda: -9))  # type: ignore[assignment]
    head._check_watchdog()
    assert head.failure is not None and "was killed by SIGKILL;" in head.failure.summary
    assert "stderr" not in head.failure.summary and "process group" in head.failure.summary


@pytest.mark.parametrize("before", [None, "", "/a::/b:"])
def test_own_module_puts_no_working_directory_on_the_path(monkeypatch, before) -> None:
    """An empty PYTHONPATH entry is the working directory: the watchdog and the id process run with -P so that no
    tray/ there shadows theirs, and `tray:` + an unset PYTHONPATH gave them one."""
    import os

    from tray.envvars import own_module

    if before is None:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    else:
        monkeypatch.setenv("PYTHONPATH", before)
    cmd, env = own_module("tray.launch.watchdog")
    entries = env["PYTHONPATH"].split(os.pathsep)
    assert cmd[1:4] == ["-P", "-m", "tray.launch.watchdog"] and "" not in entries
    assert entries[1:] == ([] if not before else ["/a", "/b"])


def test_the_fd_limit_is_raised_to_what_the_ranks_need_or_named() -> None:
    """ZeroMQ aborted the head (`Too many open files`, exit 134) under a low `ulimit -n`; the soft limit is raised
    where the hard one allows, else a SetupError names both and what the tray needs."""
    import resource
    import subprocess
    import sys

    code = """
import resource, sys
from tray.launch.spawn import ensure_fd_limit
from tray.launch.jobdir import SetupError
resource.setrlimit(resource.RLIMIT_NOFILE, (40, 200))
ensure_fd_limit(12)
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
resource.setrlimit(resource.RLIMIT_NOFILE, (40, 60))
try:
    ensure_fd_limit(12)
except SetupError as exc:
    print(exc)
"""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 200:
        pytest.skip("this machine's hard open-file limit is below 200")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == [
        "104", "the open-file limit (ulimit -n) is 40 (at most 60); a tray of 12 ranks needs about 104 descriptors in "
              "its head: raise it, or run fewer ranks"], out.stdout + out.stderr


def test_a_process_limit_too_low_for_the_tray_is_named(monkeypatch) -> None:
    """Under a low `ulimit -u` ZeroMQ aborted the head (`Resource temporarily unavailable (src/thread.cpp:241)`, exit
    134, no line of tray's) or a rank: the limit, what this user runs and what the tray starts are named before the
    spawn; a soft limit below a hard one that suffices is raised; root, whom the kernel does not hold to it, passes."""
    import os
    import resource

    from tray.launch import spawn
    from tray.launch.jobdir import SetupError

    limits = {"now": (8, 8)}
    raised = []
    real_getrlimit = resource.getrlimit

    def getrlimit(which):
        return limits["now"] if which == resource.RLIMIT_NPROC else real_getrlimit(which)

    def setrlimit(which, value):
        assert which == resource.RLIMIT_NPROC
        raised.append(value)

    monkeypatch.setattr(resource, "getrlimit", getrlimit)
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    monkeypatch.setattr(spawn, "_tasks_of", lambda uid: 3)
    monkeypatch.setattr(os, "getuid", lambda: 4321)
    with pytest.raises(SetupError, match=r"^the process limit \(ulimit -u\) is 8 \(at most 8\), and this user runs 3 "
                                         r"processes and threads now; a tray of 2 ranks starts at least 14 more: raise "
                                         r"it, or run fewer ranks$"):
        spawn.ensure_proc_limit(2)
    limits["now"] = (17, 17)  # 3 running, 4 + 2 x 5 started: within it
    spawn.ensure_proc_limit(2)
    limits["now"] = (10, 100)
    spawn.ensure_proc_limit(2)
    assert raised == [(100, 100)]
    limits["now"] = (8, 8)
    monkeypatch.setattr(os, "getuid", lambda: 0)
    spawn.ensure_proc_limit(2)
    assert raised == [(100, 100)]

def test_a_port_lock_removed_under_a_tray_is_not_taken_for_a_lock(tmp_path) -> None:
    """A tray that opened `port-P.lock` just before its holder removed it would lock a file no one else sees; the
    next tray would make a new one and lock that too: two trays on one --master-port. The inode is checked."""
    import fcntl
    import os
    import socket

    from tray.launch.jobdir import still_named
    from tray.launch.ports import PortReservation

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    name = f"port-{port}.lock"
    try:
        a = PortReservation(port=port, lock_dir_fd=dir_fd)
        stale = os.open(name, os.O_RDWR, dir_fd=dir_fd)  # a second tray got this far when ...
        a.close()  # ... the first removed the file and let go
        c = PortReservation(port=port, lock_dir_fd=dir_fd)
        fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the stale inode locks: it is no one's lock any more
        assert not still_named(stale, name, dir_fd)
        os.close(stale)
        with pytest.raises(OSError, match=rf"another tray \(head pid {os.getpid()}\) holds it"):
            PortReservation(port=port, lock_dir_fd=dir_fd)
        c.close()
        assert os.listdir(tmp_path) == []
    finally:
        os.close(dir_fd)


@pytest.mark.parametrize("groups", ["world", "world+pairs"])
def test_a_head_joining_early_takes_the_ranks_manifest_only_when_its_ids_hold_for_it(tmp_path, groups) -> None:
    """Given no --manifest, a head whose ranks join NCCL early made the ids for its own (built-in) manifest's groups
    before any rank loaded theirs. It takes the ranks' manifest when that gives every rank the same group
    instances (the ids hold); otherwise it says why it did not, and what to pass, instead of only 'manifests
    differ'."""
    from tray.launch.head import Head
    from tray.launch.spec import TraySpec
    from tray.manifest import load_manifest

    doc: dict = {"format": 1, "name": "mine", "groups": [{"name": "world", "ranks": "all"}],
                 "buffers": [{"name": "x", "dtype": "f32", "shape": [4]}]}
    if groups == "world+pairs":
        doc["groups"].append({"name": "pairs", "size": 2})
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(doc))
    digest = load_manifest(str(path)).digest
    head = Head(TraySpec(nprocs=4, cmd=("true",), backend="host"))
    head.start_join.wanted = True  # as on cuda with --join-collectives early: planned from the built-in manifest
    head.offers = {r: SimpleNamespace(manifest=digest, manifest_path=str(path)) for r in range(4)}  # type: ignore[misc]
    note = head._adopt_ranks_manifest()
    if groups == "world":
        assert note == "" and head.manifest.digest == digest
    else:
        assert head.manifest.digest != digest
        assert note == (f"the ranks' manifest ({path}) was not taken for the head's: the NCCL ids of the early join "
                        "(--join-collectives early) were made for the head's groups before the ranks loaded it, and "
                        "the ids are for none where the ranks' manifest has pairs [0, 1], pairs [2, 3]; pass tray "
                        f"launch --manifest {path} (or --join-collectives lazy)")
    head.start_join.wanted = False  # without an early join the same manifest is taken
    assert head._adopt_ranks_manifest() == "" and head.manifest.digest == digest


def test_the_head_takes_the_ranks_manifest_only_from_a_regular_file(tmp_path) -> None:
    """The path in the ranks' offers is read by the head: a FIFO there kept the head in its read for good, its
    deadlines, supervision and SIGTERM with it. It is not taken (the offers' check then names the digest
    that differs), and neither is a relative path (the ranks send absolute ones)."""
    import os
    import threading

    from tray.launch.head import Head
    from tray.launch.spec import TraySpec

    fifo = tmp_path / "m.fifo"
    os.mkfifo(fifo)
    head = Head(TraySpec(nprocs=2, cmd=("true",), backend="host"))
    ours = head.manifest.digest
    for path in (str(fifo), "m.json"):
        head.offers = {r: SimpleNamespace(manifest="ab" * 32, manifest_path=path) for r in range(2)}  # type: ignore[misc]
        notes: list[str] = []
        t = threading.Thread(target=lambda notes=notes: notes.append(head._adopt_ranks_manifest()), daemon=True)
        t.start()
        t.join(5.0)
        hung = t.is_alive()
        if hung:  # let the reader go (a writer that closes at once: the read ends empty)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            t.join(5.0)
        assert not hung and notes == [""], path
        assert head.manifest.digest == ours


def test_a_stop_signal_during_a_long_spawn_stops_it_between_two_ranks_and_the_spawn_says_its_progress(
        monkeypatch, tmp_path) -> None:
    """`tray launch -n 1000` on 2 cores: the ranks took minutes to start, one fork at a time, and a Ctrl-C was only
    noted, acted on once every rank had started (the head had to be killed); nothing was said meanwhile."""
    import signal

    from tray.launch import head as head_mod
    from tray.launch.head import Head
    from tray.launch.spec import TraySpec

    head = Head(TraySpec(nprocs=50, cmd=("true",), backend="host"))
    said: list[str] = []
    spawned: list[int] = []

    def spawn(spec, rank, env, placement, group):
        spawned.append(rank)
        if rank == 3:
            head._signals.append(signal.SIGINT)  # as the held handler notes it
        return SimpleNamespace(rank=rank)

    monkeypatch.setattr(head_mod, "spawn_rank", spawn)
    monkeypatch.setattr(head_mod, "_say", said.append)
    monkeypatch.setattr(head_mod, "_SPAWN_SAY_S", 0.0)
    with pytest.raises(KeyboardInterrupt):
        head._spawn_all(tmp_path, "ipc://x", 0)
    assert spawned == [0, 1, 2, 3] and len(head.procs) == 4  # the teardown stops those
    assert said == [f"started {r} of 50 ranks in 0 s" for r in range(4)]


def test_the_head_says_whom_its_handshake_waits_for_every_10_s_before_it_gives_up(monkeypatch) -> None:
    """A rank that never reaches tray.init() left the tray silent for the whole --timeout-s (30 s by default), where
    the root of a job of several nodes says whom it waits for every 10 s."""
    import time

    from tray.launch import head as head_mod
    from tray.launch.head import Head
    from tray.launch.spec import RankProcess, TraySpec

    head = Head(TraySpec(nprocs=2, cmd=("true",), backend="host", handshake_timeout_s=30.0))
    head.procs = [RankProcess(rank=r, popen=SimpleNamespace(pid=4000 + r, poll=lambda: None),  # type: ignore[arg-type]
                              t_spawn=time.time() - 12) for r in range(2)]
    head.procs[0].last_heartbeat = time.monotonic()
    head.offers = {0: SimpleNamespace()}  # type: ignore[dict-item]
    said: list[str] = []
    monkeypatch.setattr(head_mod, "_say", said.append)
    head.t_first_contact = time.monotonic() - 5
    head._check_deadlines()
    assert said == []  # 5 s in: nothing yet
    head.t_first_contact = time.monotonic() - 11
    head._check_deadlines()
    head._check_deadlines()  # said once per 10 s
    assert len(said) == 1 and said[0].startswith("waiting for rank 1 to offer (1 of 2 did, 11 s; gives up after "
                                                 "--timeout-s 30 s): rank 1 alive, last phase: spawn: not heard from "
                                                 "in its 12."), said
    assert head.failure is None
    head.t_first_contact = time.monotonic() - 31
    head._check_deadlines()
    assert head.failure is not None and "rank 1 did not offer within 30 s" in head.failure.summary
    assert len(said) == 1


def test_the_votes_of_steps_given_up_do_not_make_each_later_vote_judge_them_all(monkeypatch) -> None:
    """A program that gives steps up (a caught timeout, in a loop) leaves each one's votes at the head until its
    decision, the round never reused. The deadlock check judged every one of them on every vote: each vote of the
    tray took ~1.2 us longer per step given up. It judges the steps of the ranks' latest votes, and still finds a
    cycle among them."""
    import time

    from tray.handshake import wire
    from tray.launch import head as head_mod
    from tray.launch.head import Head
    from tray.launch.spec import RankProcess, TraySpec

    head = Head(TraySpec(nprocs=2, cmd=("true",), backend="host"))
    head.procs = [RankProcess(rank=r, popen=SimpleNamespace(pid=4000 + r, poll=lambda: None),  # type: ignore[arg-type]
                              t_spawn=time.time()) for r in range(2)]
    judged: list[int] = []
    crossed = head_mod.crossed_steps
    monkeypatch.setattr(head_mod, "crossed_steps", lambda boxes, *a: judged.append(len(boxes)) or crossed(boxes, *a))

    def vote(rank: int, topic: str, rnd: int, wait_s: float) -> None:
        head._on_vote(None, wire.Vote(token=head.token, rank=rank, topic=topic, round=rnd, value=0,  # type: ignore[arg-type]
                                      wait_s=wait_s))

    for rnd in range(1, 501):  # given up at once (as if its 0.01 s ran out)
        vote(0, "poll", rnd, 0.01)
    time.sleep(0.05)
    vote(0, "a", 1, 60.0)
    assert head.failure is None and len(head.votes) == 501 and max(judged) <= 2, judged
    vote(1, "b", 1, 60.0)  # rank 0 waits in 'a' for rank 1, which waits in 'b' for rank 0: crossed
    assert head.failure is not None and "'a'" in head.failure.summary and "'b'" in head.failure.summary
    assert max(judged) <= 2, judged


def test_a_stop_after_close_is_timed_over_the_heads_own_looks(monkeypatch) -> None:
    """A rank stopped after it closed its tray fails the tray after --heartbeat-timeout-s; a job suspended and resumed
    (the ranks and the head stopped, the head continued first) failed it at the head's first look after the resume,
    the time the head itself was stopped counted."""
    import os
    import signal
    import subprocess
    import time

    from tray.launch import head as head_mod
    from tray.launch.head import Head
    from tray.launch.spec import RankProcess, TraySpec

    head = Head(TraySpec(nprocs=1, cmd=("true",), backend="host", heartbeat_timeout_s=10.0))
    monkeypatch.setattr(head_mod, "_say", lambda text: None)
    child = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while head_mod.stat_fields(child.pid)[0] != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        head.procs = [RankProcess(rank=0, popen=child, t_spawn=time.time(), phase="bye", phase_at=t0)]
        head._check_closed_ranks(t0)
        head._check_closed_ranks(t0 + 0.5)
        head._check_closed_ranks(t0 + 12.0)  # the head did not run for 11.5 s: its look restarts the stop's time
        assert head.failure is None
        for k in range(1, 20):  # looks a turn apart, as the loop's
            head._check_closed_ranks(t0 + 12.0 + 0.6 * k)
            if head.failure is not None:
                break
        assert head.failure is not None and 10.0 < 0.6 * k <= 10.8, k
        assert "has been stopped for 10.2 s since (state T:" in head.failure.summary, head.failure.summary
    finally:
        child.kill()
        child.wait()


def test_the_bytes_left_in_a_pipe_are_counted() -> None:
    """What a rank's stream still held when the teardown's drain ran out was dropped without a word; it is counted
    (FIONREAD) and said."""
    import os

    from tray.launch.spawn import _unread_nbytes

    r, w = os.pipe()
    try:
        assert _unread_nbytes(r) == 0
        os.write(w, b"x" * 1234)
        assert _unread_nbytes(r) == 1234
        os.read(r, 1000)
        assert _unread_nbytes(r) == 234
    finally:
        os.close(r)
        os.close(w)
    assert _unread_nbytes(r) == 0  # closed: not told
