"""The cuda backend on real GPUs, in one process: VMM export/import, NVRTC kernels and their arguments,
the multicast refusal, the peer barrier (passing, captured, and timing out), timers, and the doctor.

Runs on device 0, and on device 1 too when a second GPU is visible. Skipped only when no GPU is."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from tray.backend.base import ExportedHandle, GroupInfo
from tray.backend.cuda import CudaBackend, visible_gpu_count
from tray.backend.cuda.doctor import REPORT_KEYS, doctor_report, format_doctor
from tray.errors import BarrierTimeout, UsageError

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("isolated_kernel_cache")]

GPUS = visible_gpu_count()
if GPUS == 0:
    pytest.skip("no GPU visible", allow_module_level=True)

KERNELS = Path(__file__).resolve().parents[2] / "manifests" / "kernels"

ARGS_KERNEL = r"""
extern "C" __global__ void tray_test_args(unsigned long long* out, int a, unsigned int b, long long c,
                                          float d, double e, unsigned long long* const* table) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        out[0] = (unsigned long long)(long long)a;
        out[1] = b;
        out[2] = (unsigned long long)c;
        out[3] = __float_as_uint(d);
        out[4] = (unsigned long long)__double_as_longlong(e);
        out[5] = (unsigned long long)table[1];
    }
}
"""

TICK_KERNEL = r"""
extern "C" __global__ void tray_test_tick(unsigned long long* count) { atomicAdd(count, 1ull); }
"""

MULTIMEM_KERNEL = r"""
extern "C" __global__ void tray_test_multimem(unsigned int* p, unsigned int v) {
    asm volatile("multimem.st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
"""


@pytest.fixture(scope="module")
def backend():
    b = CudaBackend.open(0)
    yield b
    b.close()


def fill_reference(G: int, me: int, g: int, words: int, seed: int) -> np.ndarray:
    """What tray_peer_fill writes into member g's slot `me` (u32[words])."""
    i = np.arange(words, dtype=np.uint64)
    base = (seed * 0x9E3779B1 & 0xFFFFFFFF) ^ (me << 24) ^ (g << 16)
    return (np.uint64(base) ^ (i & np.uint64(0xFFFFFFFF))).astype(np.uint32)


def test_open_reports_the_device(backend) -> None:
    info = backend.info
    assert info.ordinal == 0
    assert info.uuid.startswith("GPU-") and len(info.uuid) == 40
    assert len(info.pci_bus.split(":")) == 3 and info.pci_bus == info.pci_bus.lower()
    assert info.numa_node >= -1 and info.name
    assert backend.capability >= (7, 0)
    assert isinstance(backend.stream_handle, int) and backend.stream_handle != 0


def test_allocate_export_import_roundtrip(backend) -> None:
    buf = backend.allocate("roundtrip", 3 << 20, export=True)
    assert buf.nbytes == 3 << 20 and buf.mapped_nbytes >= buf.nbytes
    assert not backend.read(buf.ptr, buf.mapped_nbytes).any(), "a new buffer is zeroed"
    handle = buf.handle()
    assert handle.fd is not None and handle.nbytes == buf.mapped_nbytes
    mapping = backend.import_peer(ExportedHandle("posix", handle.nbytes, fd=os.dup(handle.fd)))
    assert mapping.ptr != buf.ptr and mapping.nbytes == handle.nbytes
    pattern = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    backend.write(mapping.ptr + 4096, pattern)
    assert bytes(backend.read(buf.ptr + 4096, pattern.nbytes)) == pattern.tobytes()
    mapping.close()
    buf.close()
    with pytest.raises(UsageError):
        backend.write(buf.ptr, np.zeros(8, np.uint8)[::2])


@pytest.mark.skipif(GPUS < 2, reason="needs a second GPU")
def test_import_on_a_second_gpu_and_write_through_it(backend) -> None:
    words = 1 << 16
    buf = backend.allocate("shared", 4 * words, export=True)
    other = CudaBackend.open(1)
    try:
        mapping = other.import_peer(ExportedHandle("posix", buf.handle().nbytes, fd=os.dup(buf.handle().fd)))
        table = other.ptr_table([mapping.ptr])
        fill = other.load_kernel("peer_fill", (KERNELS / "peer_fill.cu").read_bytes(), "tray_peer_fill",
                                 [], peers=True)
        fill.launch((4, 1, 1), (256, 1, 1), [table, 1, 0, words, 11])
        other.synchronize()
    finally:
        other.close()
    got = backend.read(buf.ptr, 4 * words).view(np.uint32)
    assert np.array_equal(got, fill_reference(1, 0, 0, words, 11))
    buf.close()


def test_kernel_arguments_int_float_pointer(backend) -> None:
    path = Path(os.environ["TRAY_CACHE_DIR"]) / "args.cu"
    path.write_text(ARGS_KERNEL)
    kernel = backend.load_kernel("test_args", path.read_bytes(), "tray_test_args", ["-lineinfo"], peers=False)
    assert kernel.param_sizes == [8, 4, 4, 8, 4, 8, 8]
    out = backend.allocate("out", 64, export=False)
    table = backend.ptr_table([0x1000, 0xDEAD_BEEF_0000])
    kernel.launch((1, 1, 1), (32, 1, 1), [out, -7, 2**32 - 2, -(2**40), 1.5, -2.25, table])
    got = backend.read(out.ptr, 48).view(np.uint64)
    assert int(got[0]) == (-7) & (2**64 - 1)
    assert int(got[1]) == 2**32 - 2
    assert int(got[2]) == (-(2**40)) & (2**64 - 1)
    assert int(got[3]) == int(np.float32(1.5).view(np.uint32))
    assert int(got[4]) == int(np.float64(-2.25).view(np.uint64))
    assert int(got[5]) == 0xDEAD_BEEF_0000
    with pytest.raises(UsageError, match="takes 7 parameters"):
        kernel.bind((1, 1, 1), (32, 1, 1), [out])


def test_peer_fill_two_members_on_one_gpu(backend) -> None:
    words, seed = 4096, 3
    bufs = [backend.allocate(f"fill{g}", 2 * 4 * words, export=False) for g in range(2)]
    table = backend.ptr_table([b.ptr for b in bufs])
    fill = backend.load_kernel("peer_fill", (KERNELS / "peer_fill.cu").read_bytes(), "tray_peer_fill",
                               [], peers=True)
    for me in range(2):
        fill.launch((8, 1, 1), (128, 1, 1), [table, 2, me, words, seed])
    for g, buf in enumerate(bufs):
        got = backend.read(buf.ptr, 2 * 4 * words).view(np.uint32)
        for me in range(2):
            assert np.array_equal(got[me * words:(me + 1) * words], fill_reference(2, me, g, words, seed))


def test_compile_errors_carry_nvrtc_log(backend) -> None:
    path = Path(os.environ["TRAY_CACHE_DIR"]) / "broken.cu"
    path.write_text('extern "C" __global__ void tray_broken(int* p) { p[0] = undefined_name; }\n')
    with pytest.raises(UsageError, match="undefined_name"):
        backend.load_kernel("broken", path.read_bytes(), "tray_broken", [], peers=False)
    with pytest.raises(UsageError, match="--no-such-option"):
        backend.load_kernel("broken", path.read_bytes(), "tray_broken", ["--no-such-option"], peers=False)


def test_multimem_kernel_refused_at_load(backend) -> None:
    path = Path(os.environ["TRAY_CACHE_DIR"]) / "multimem.cu"
    path.write_text(MULTIMEM_KERNEL)
    with pytest.raises(UsageError, match=r"'bad_multicast'.*multimem\.st"):
        backend.load_kernel("bad_multicast", path.read_bytes(), "tray_test_multimem", [], peers=True)


def test_barrier_of_one_eager_and_captured(backend) -> None:
    group = GroupInfo("solo", (0,), 0)
    flags = backend.allocate("flags", 8, export=True)
    table = backend.ptr_table([flags.ptr])
    barrier = backend.barrier(group, flags, table)
    for _ in range(1000):
        barrier.wait(2.0)
    assert barrier.epoch() == 1000
    graph = backend.capture(lambda: [barrier.launch(2.0) for _ in range(100)])
    for _ in range(3):
        graph.replay()
    barrier.synchronize()
    barrier.check()
    assert barrier.epoch() == 1300, "every replayed barrier takes a fresh epoch"
    assert int(backend.read(flags.ptr, 8).view(np.uint64)[0]) == 1300
    graph.close()
    barrier.close()


def test_barrier_eager_graph_and_kernel_launches_agree(backend, monkeypatch) -> None:
    """Eager launches through the one-barrier graph and through cuLaunchKernelEx, alone and interleaved,
    each take one epoch; inside backend.capture the launches are kernel launches the graph replays."""
    monkeypatch.delenv("TRAY_BARRIER_LAUNCH", raising=False)
    flags = backend.allocate("flags_paths", 8, export=True)
    barrier = backend.barrier(GroupInfo("solo_paths", (0,), 0), flags, backend.ptr_table([flags.ptr]))
    assert barrier.mode == "graph"
    expected = 0
    for launch in (barrier.launch, barrier.launch_kernel):
        for _ in range(500):
            launch(2.0)
        expected += 500
        barrier.synchronize()
        barrier.check()
        assert barrier.epoch() == expected
    for i in range(100):
        (barrier.launch if i % 2 else barrier.launch_kernel)(0.5 if i % 3 else 2.0)
    expected += 100
    graph = backend.capture(lambda: [barrier.launch(2.0) for _ in range(10)])
    graph.replay()
    graph.replay()
    expected += 20
    barrier.synchronize()
    barrier.check()
    assert barrier.epoch() == expected
    assert int(backend.read(flags.ptr, 8).view(np.uint64)[0]) == expected
    graph.close()
    barrier.close()


def test_barrier_joined_to_a_capturing_caller_stream_is_recorded(backend, monkeypatch) -> None:
    """What `rank.run(program, stream=s)` does under a capture on `s` (torch.cuda.graph): the rank's stream
    is pulled into the capture, so a barrier launched on it there must be recorded, not replay a graph."""
    from tray.backend.cuda import driver as drv

    monkeypatch.delenv("TRAY_BARRIER_LAUNCH", raising=False)
    flags = backend.allocate("flags_joined", 8, export=True)
    barrier = backend.barrier(GroupInfo("solo_joined", (0,), 0), flags, backend.ptr_table([flags.ptr]))
    barrier.wait(2.0)  # the one-barrier graph exists before the capture
    caller = drv.stream_create()
    try:
        drv.stream_begin_capture(caller)
        with backend.joined(int(caller)):
            for _ in range(5):
                barrier.launch(2.0)
        graph = drv.stream_end_capture(caller)
        graph_exec = drv.graph_instantiate(graph)
        for _ in range(3):
            drv.graph_launcher(graph_exec, caller)()
        drv.stream_synchronize(caller)
        drv.graph_exec_destroy(graph_exec)
        drv.graph_destroy(graph)
    finally:
        drv.stream_destroy(caller)
    barrier.check()
    assert barrier.epoch() == 1 + 15
    barrier.close()


def test_a_refused_launch_is_a_named_error(backend) -> None:
    """A block of 2048 threads (the limit is 1024): the driver refuses, CudaError names the call and kernel,
    and the stream stays usable."""
    from tray.backend.cuda.driver import CudaError

    tick = backend.load_kernel("tick", TICK_KERNEL.encode(), "tray_test_tick", [], peers=False)
    count = backend.allocate("ticks", 8, export=False)
    backend.write(count.ptr, np.zeros(1, np.uint64))
    for programmatic, call in ((False, "cuLaunchKernel"), (True, "cuLaunchKernelEx")):
        bad = tick.bind((1, 1, 1), (2048, 1, 1), [count], programmatic=programmatic)
        with pytest.raises(CudaError) as info:
            bad.launch()
        assert info.value.call == call
        assert info.value.code in ("CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")
        assert "tray_test_tick, grid (1, 1, 1), block (2048, 1, 1)" in str(info.value)
    tick.bind((1, 1, 1), (1, 1, 1), [count]).launch()
    backend.synchronize()
    assert int(backend.read(count.ptr, 8).view(np.uint64)[0]) == 1


def test_barrier_names_the_missing_member_then_stays_broken(backend) -> None:
    group = GroupInfo("pair", (0, 7), 0)
    flags = backend.allocate("flags2", 16, export=True)
    ghost = backend.allocate("ghost", 16, export=True)  # member 1's flags: nobody ever writes ours
    barrier = backend.barrier(group, flags, backend.ptr_table([flags.ptr, ghost.ptr]))
    start = time.monotonic()
    with pytest.raises(BarrierTimeout) as info:
        barrier.wait(0.5)
    elapsed = time.monotonic() - start
    assert 0.45 <= elapsed < 1.0
    err = info.value
    assert (err.group, err.epoch, err.rank, err.missing, err.waited_s) == ("pair", 1, 0, [7], 0.5)
    assert int(backend.read(ghost.ptr, 8).view(np.uint64)[0]) == 1, "we announced epoch 1 to member 1"
    start = time.monotonic()
    with pytest.raises(BarrierTimeout):
        barrier.wait(0.5)
    assert time.monotonic() - start < 0.1, "a broken barrier returns at once"
    barrier.close()


def test_capture_body_that_raises_leaves_the_stream_usable(backend) -> None:
    def body() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        backend.capture(body)
    buf = backend.allocate("after", 64, export=False)
    backend.write(buf.ptr, np.arange(64, dtype=np.uint8))
    assert bytes(backend.read(buf.ptr, 64)) == bytes(range(64))


def test_timer_measures_work(backend) -> None:
    words = 16 << 20
    buf = backend.allocate("timed", 4 * words, export=False)
    table = backend.ptr_table([buf.ptr])
    fill = backend.load_kernel("peer_fill", (KERNELS / "peer_fill.cu").read_bytes(), "tray_peer_fill",
                               [], peers=True)
    timer = backend.timer()
    timer.start()
    fill.launch((132, 1, 1), (256, 1, 1), [table, 1, 0, words, 1])
    timer.stop()
    assert 0 < timer.elapsed_s() < 1.0


def test_doctor_report_has_every_key(backend) -> None:
    report = doctor_report()
    assert set(REPORT_KEYS) <= set(report)
    assert len(report["gpus"]) == GPUS
    assert len(report["p2p"]) == GPUS * (GPUS - 1)
    assert all(h["posix"] == "ok" for h in report["handle_types"])
    assert all(c["h2d"] > 0 and c["d2h"] > 0 for c in report["host_copy_gbps"])
    assert isinstance(format_doctor(report), str)


def test_copies_through_pinned_host_and_the_transfer_stream(backend) -> None:
    nbytes = 3 << 20
    pattern = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    src_host = backend.pinned_host(nbytes)
    dst_host = backend.pinned_host(nbytes)
    assert src_host.nbytes == nbytes and src_host.numa_node == backend.info.numa_node
    src_host.view()[:] = pattern
    a = backend.allocate("copy_a", nbytes, export=False)
    b = backend.allocate("copy_b", nbytes, export=True)
    backend.copy(a.ptr, src_host.ptr, nbytes)  # host -> device
    backend.copy(b.ptr, a.ptr, nbytes)  # device -> device
    backend.copy(dst_host.ptr, b.ptr, nbytes, transfer=True)  # waits for the two copies before it
    backend.sync_transfer()
    assert np.array_equal(dst_host.view(), pattern)
    src_host.close()
    dst_host.close()


def test_gemm_row_major_with_accumulate(backend) -> None:
    pytest.importorskip("nvmath", reason="nvmath-python carries the cuBLAS bindings")
    import ml_dtypes

    m, n, k = 64, 48, 32
    rng = np.random.default_rng(3)
    a = rng.integers(-2, 3, (m, k)).astype(ml_dtypes.bfloat16)
    b = rng.integers(-2, 3, (n, k)).astype(ml_dtypes.bfloat16)
    expect = a.astype(np.float64) @ b.astype(np.float64).T  # small ints: exact in bf16
    bufs = {name: backend.allocate(f"gemm_{name}", size * 2, export=False)
            for name, size in (("a", m * k), ("b", n * k), ("c", m * n))}
    backend.write(bufs["a"].ptr, a)
    backend.write(bufs["b"].ptr, b)
    backend.gemm(bufs["a"].ptr, bufs["b"].ptr, bufs["c"].ptr, m, n, k, "bf16")
    got = backend.read(bufs["c"].ptr, m * n * 2).view(ml_dtypes.bfloat16).reshape(m, n)
    assert np.array_equal(got.astype(np.float64), expect)
    backend.gemm(bufs["a"].ptr, bufs["b"].ptr, bufs["c"].ptr, m, n, k, "bf16", accumulate=True)
    got = backend.read(bufs["c"].ptr, m * n * 2).view(ml_dtypes.bfloat16).reshape(m, n)
    assert np.array_equal(got.astype(np.float64), 2 * expect)
    ptrs = (bufs["a"].ptr, bufs["b"].ptr, bufs["c"].ptr)
    graph = backend.capture(lambda: backend.gemm(*ptrs, m, n, k, "bf16"))
    graph.replay()
    got = backend.read(bufs["c"].ptr, m * n * 2).view(ml_dtypes.bfloat16).reshape(m, n)
    assert np.array_equal(got.astype(np.float64), expect)


@pytest.mark.skipif(GPUS < 2, reason="needs a second GPU")
def test_barrier_across_two_gpus_eager_and_captured(backend) -> None:
    """Two members on two GPUs of this process, flags peer-mapped over NVLink both ways."""
    other = CudaBackend.open(1)
    backends = (backend, other)
    owned_here: list = []  # device 0's share, closed before device 1 goes away
    try:
        flags = [b.allocate(f"duo{i}", 16, export=True) for i, b in enumerate(backends)]
        peer_of = [backends[i].import_peer(ExportedHandle("posix", flags[1 - i].handle().nbytes,
                                                          fd=os.dup(flags[1 - i].handle().fd)))
                   for i in range(2)]
        tables = [backends[0].ptr_table([flags[0].ptr, peer_of[0].ptr]),
                  backends[1].ptr_table([peer_of[1].ptr, flags[1].ptr])]
        barriers = [b.barrier(GroupInfo("duo", (0, 1), i), flags[i], tables[i])
                    for i, b in enumerate(backends)]
        owned_here += [barriers[0], tables[0], peer_of[0], flags[0]]
        for _ in range(200):
            for b, bar in zip(backends, barriers):
                b.make_current()
                bar.launch(2.0)
        graphs = [b.capture(lambda bar=bar: [bar.launch(2.0) for _ in range(100)])
                  for b, bar in zip(backends, barriers)]
        owned_here.insert(0, graphs[0])
        for b, graph in zip(backends, graphs):
            b.make_current()
            graph.replay()
        for b, bar in zip(backends, barriers):
            b.synchronize()
            bar.check()
            assert bar.epoch() == 300
        assert [int(v) for v in backend.read(flags[0].ptr, 16).view(np.uint64)] == [300, 300]
    finally:
        backend.make_current()
        for obj in owned_here:
            obj.close()
        other.close()
