"""The host-twin registry: `@tray.twin` registers, the host backend finds it, an unknown kernel is named."""

from __future__ import annotations

import numpy as np
import pytest

import tray
from tray import twins
from tray.backend.host import HostBackend
from tray.errors import UsageError


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(twins, "_TWINS", dict(twins._TWINS))
    return twins


def test_a_user_twin_runs_on_the_host_backend(registry):
    @tray.twin("test_scale")
    def scale(backend, grid, block, dst: int, count: int, factor: float) -> None:
        registry.f32_at(dst, count)[:] *= factor

    assert "test_scale" in registry.registered()
    data = np.arange(4, dtype=np.float32)
    backend = HostBackend.open(0)
    kernel = backend.load_kernel("test_scale", b"", "test_scale", (), False)
    assert kernel is not None
    registry.lookup("test_scale")(backend, (1, 1, 1), (1, 1, 1), data.ctypes.data, 4, 2.0)
    assert data.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_an_unknown_kernel_names_itself_and_how_to_register_a_twin(registry):
    with pytest.raises(UsageError, match=r'kernel \'nope\' has no host twin .*@tray\.twin\("nope"\)'):
        HostBackend.open(0).load_kernel("nope", b"", "nope", (), False)


def test_a_second_twin_under_a_taken_name_is_refused(registry):
    registry.twin("test_once")(lambda *a: None)
    with pytest.raises(UsageError, match="already has a host twin"):

        @registry.twin("test_once")
        def other(*args) -> None:
            pass


def _libc_mmap():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_access_fault_names_the_first_page_out_of_reach_and_finds_memory_mapped_since_its_last_reading():
    """mincore tells mapped from unmapped only: a PROT_NONE reservation (a GPU driver's range, a guard page) passed,
    as did a read-only page given to be written; a collective over them killed the rank."""
    import mmap

    libc, page = _libc_mmap(), mmap.PAGESIZE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    twins._read_maps()  # a reading from before the mappings below: they are found by reading again
    base = libc.mmap(None, 4 * page, rw, flags, -1, 0)
    assert base not in (None, 2**64 - 1), "mmap failed"
    try:
        assert libc.mprotect(base + 2 * page, page, 0) == 0          # page 2: no access
        assert libc.mprotect(base + 3 * page, page, mmap.PROT_READ) == 0  # page 3: read-only
        assert twins.access_fault(base, 2 * page, write=True) is None  # pages 0-1, whatever mappings they are
        assert twins.access_fault(base + 8, 2 * page, write=False) == (
            f"has memory mapped without access at {base + 2 * page:#x} ({2 * page - 8} B in): a reservation such as "
            "a GPU's device memory, a guard page, or an allocator's unused reserve")
        assert twins.access_fault(base + 3 * page, page, write=False) is None
        assert twins.access_fault(base + 3 * page + 4, 8, write=True) == (
            f"has read-only memory at {base + 3 * page + 4:#x} (0 B in), which this rank may not write")
        assert twins.access_fault(base, 0, write=True) is None
    finally:
        libc.munmap(base, 4 * page)
    assert twins.access_fault(base, 8).startswith("is not all memory of this process")  # mincore says so first


def test_first_fault_walks_adjacent_mappings_and_names_a_gap_between_them():
    maps = [(0x1000, 0x3000, True, True), (0x3000, 0x4000, True, False), (0x5000, 0x6000, False, False)]
    reading = ([m[0] for m in maps], maps)
    assert twins._first_fault(0x1000, 0x4000, False, reading) is None       # two mappings, one after the other
    assert twins._first_fault(0x1000, 0x4000, True, reading) == (0x3000, "read-only")
    assert twins._first_fault(0x2000, 0x4800, False, reading) == (0x4000, "unmapped")  # the gap
    assert twins._first_fault(0x800, 0x1800, False, reading) == (0x800, "unmapped")    # before the first
    assert twins._first_fault(0x4100, 0x4200, False, reading) == (0x4100, "unmapped")  # inside the gap
    assert twins._first_fault(0x5000, 0x5001, False, reading) == (0x5000, "no access")
    assert twins._first_fault(0x6000, 0x6001, False, reading) == (0x6000, "unmapped")  # past the last
    assert twins._first_fault(0x2000, 0x2000, True, reading) is None  # nothing asked


def test_a_reading_of_the_maps_is_published_whole():
    """The starts and the mappings were two lists, assigned one after the other: a thread that missed the cache while
    another read the maps again could index one reading's mappings with the other's starts (a PROT_NONE page passed,
    or an IndexError)."""
    reading = twins._read_maps()
    if reading is None:
        pytest.skip("needs /proc/self/maps")
    assert twins._MAPPINGS is reading
    starts, maps = reading
    assert starts == [m[0] for m in maps] and starts == sorted(starts) and maps
    assert all(hi > lo for lo, hi, _, _ in maps)


@pytest.fixture
def regions(monkeypatch):
    """A rank's region table of its own for one test (in a rank the host backend fills it)."""
    monkeypatch.setattr(twins, "_REGIONS", {})
    monkeypatch.setattr(twins, "_NAMES", {})
    monkeypatch.setattr(twins, "_STARTS", [])
    monkeypatch.setattr(twins, "_MAPPED_ENDS", {})
    return twins


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_a_twins_view_at_or_past_a_buffers_end_or_of_memory_it_may_not_touch_is_refused_not_a_crash(regions):
    """A buffer of 512 B in a page of its own: a view starting at its end (the page's padding, where on a GPU the next
    allocation lies) was not judged, and one a page past it killed the rank by SIGSEGV; both are UsageErrors naming
    the range. A read-only page gives a read-only view; a view inside the buffer is unchanged."""
    import mmap

    libc = _libc_mmap()
    page = mmap.PAGESIZE
    base = libc.mmap(None, 3 * page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    try:
        assert libc.munmap(base + page, page) == 0  # the page after the buffer's: a hole
        assert libc.mprotect(base + 2 * page, page, mmap.PROT_READ) == 0
        regions.add_region(base, 512, "buffer 'p'", page)
        regions.f32_at(base, 128)[:] = 1.0
        assert regions.f32_at(base + 256, 64).sum() == 64.0
        for ptr, count in ((base + 512, 1), (base + 1536, 128), (base + 508, 2)):
            with pytest.raises(UsageError, match=r"kernel twin reaches .*buffer 'p' of 512 B"):
                regions.f32_at(ptr, count)
        with pytest.raises(UsageError, match=r"at or past its end"):
            regions.u32_at(base + 512, 1)
        with pytest.raises(UsageError, match=r"kernel twin's view of 4 B at .* is not all memory of this process"):
            regions.f32_at(base + page, 1)
        with pytest.raises(UsageError, match=r"is no memory"):
            regions.u64_at(8, 1)
        ro = regions.u64_at(base + 2 * page, 4)
        assert ro.tolist() == [0, 0, 0, 0] and not ro.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            ro[0] = 1
        private = np.zeros(4, np.float32)  # the program's own memory: as before
        regions.f32_at(private.ctypes.data, 4)[:] = 2.0
        assert private.tolist() == [2.0] * 4
    finally:
        libc.munmap(base, page)
        libc.munmap(base + 2 * page, page)
