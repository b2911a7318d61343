"""Host twins: numpy stand-ins for CUDA kernels, so a manifest's programs run on the host backend.

A twin is registered under its kernel's manifest name and is called as
`twin(backend, grid, block, *args)` with the arguments the CUDA kernel gets (addresses as ints, scalars
as ints or floats); it must write exactly the bytes the kernel writes.

    import tray

    @tray.twin("my_scale")
    def my_scale(backend, grid, block, dst: int, count: int, factor: float) -> None:
        tray.twins.f32_at(dst, count)[:] *= factor

Registration happens when the module holding the twin is imported, so a rank imports its twins before
`tray.init()` (the host backend looks a kernel up when a program first loads it; importing first keeps
that independent of when). The built-in programs do this in
their rank programs: `tray.programs.ep_moe.rank_program` imports `tray.programs.ep_moe.twins`, and so on.
The generic kernels every tray may use (`peer_fill`) are registered by the host backend itself.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import re
from collections.abc import Callable
from typing import Any

import numpy as np

Twin = Callable[..., None]

_TWINS: dict[str, Twin] = {}


def twin(name: str) -> Callable[[Twin], Twin]:
    """Decorator: register `fn` as the host twin of the manifest kernel `name` (the kernel entry's "name").

    Raises UsageError when a different function is already registered under `name`."""

    def register(fn: Twin) -> Twin:
        have = _TWINS.get(name)
        if have is not None and have is not fn and _qualname(have) != _qualname(fn):
            from tray.errors import UsageError

            raise UsageError(f"kernel {name!r} already has a host twin ({_qualname(have)}); "
                             f"{_qualname(fn)} would replace it: give one of the kernels another name")
        _TWINS[name] = fn
        return fn

    return register


def _qualname(fn: Twin) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def lookup(name: str) -> Twin:
    """The twin registered for kernel `name`. Raises UsageError naming the kernel and how to register one."""
    fn = _TWINS.get(name)
    if fn is None:
        from tray.errors import UsageError
        from tray.manifest.expr import did_you_mean

        known = ", ".join(registered()) or "none"
        raise UsageError(
            f"kernel {name!r} has no host twin (registered: {known}{did_you_mean(name, _TWINS)}); define one with "
            f'@tray.twin("{name}") in a module the rank imports before tray.init(), or run with --backend cuda'
        )
    return fn


def registered() -> tuple[str, ...]:
    """The kernel names that have a twin, sorted."""
    return tuple(sorted(_TWINS))


# The memory a rank's host backend mapped (start -> end): its buffers, its peers' mappings, its host pools and
# pointer tables. In a rank, a twin's view that starts in one of them and runs past its end, or starts in the page
# rounding past its end (a mapping is whole pages: an overrun there reads or writes the padding, where on a GPU it
# would reach the next allocation), is an error naming the range (a buffer the manifest sized too small for what the
# kernel reads or writes), not a silent overwrite of whatever lies next to it; a view of memory outside every region
# that this process may not touch is an error too, not a SIGSEGV. Empty (unchecked) outside a rank: twins called on
# plain numpy arrays.
_REGIONS: dict[int, int] = {}
_NAMES: dict[int, str] = {}
_STARTS: list[int] = []
_MAPPED_ENDS: dict[int, int] = {}  # start -> the end of the mapping that holds the region, where it is past the end


def add_region(ptr: int, nbytes: int, name: str = "", mapped_nbytes: int = 0) -> None:
    """Memory at [ptr, ptr + nbytes) that twins may touch; `name` says what it is ("buffer 'x'"). `mapped_nbytes`:
    what the mapping holding it spans from `ptr` (its page rounding), when more: a range starting there is judged
    as past the region's end rather than as memory of no region."""
    _REGIONS[ptr] = ptr + nbytes
    _NAMES[ptr] = name
    if mapped_nbytes > nbytes:
        _MAPPED_ENDS[ptr] = ptr + mapped_nbytes
    else:
        _MAPPED_ENDS.pop(ptr, None)
    _STARTS[:] = sorted(_REGIONS)


def remove_region(ptr: int) -> None:
    if _REGIONS.pop(ptr, None) is not None:
        _NAMES.pop(ptr, None)
        _MAPPED_ENDS.pop(ptr, None)
        _STARTS[:] = sorted(_REGIONS)


def check_range(ptr: int, nbytes: int, what: str = "") -> None:
    """Raise UsageError when [ptr, ptr + nbytes) starts inside a registered region and runs past its end, or starts
    past its end within the mapping that holds it (the page rounding). Memory outside every region is the program's
    own (a tensor it allocated, say) and is not judged. `what` names the access (default: a kernel twin's)."""
    if not _REGIONS or nbytes <= 0:
        return
    i = bisect.bisect_right(_STARTS, ptr) - 1
    if i < 0:
        return
    start = _STARTS[i]
    end = _REGIONS[start]
    if ptr + nbytes <= end or ptr >= _MAPPED_ENDS.get(start, end):
        return
    from tray.errors import UsageError

    region = _NAMES.get(start) or "a region"
    where = f"{ptr - start} B into {region} of {end - start} B"
    fix = "a count that fits the buffer"
    if ptr >= end:
        where += ": at or past its end, in its mapping's page rounding"
        fix = "an address inside the buffer (its offset is past the end)"
    if what:
        raise UsageError(f"{what} reaches {nbytes} B at {ptr:#x} ({where}), past its end: pass {fix} (on a GPU this "
                         "would read or overwrite whatever lies next to it)")
    raise UsageError(f"a kernel twin reaches {nbytes} B at {ptr:#x} ({where}), past the end of the memory it was "
                     "given: a buffer in the manifest is smaller than what the kernel reads or writes there (on a GPU "
                     "this would overwrite or read whatever lies next to it); check the buffer's shape against the "
                     "kernel's args" + (", and the offsets it computes" if ptr >= end else ""))


def in_region(ptr: int, nbytes: int) -> bool:
    """Whether [ptr, ptr + nbytes) lies within one registered region (memory the rank's backend mapped)."""
    i = bisect.bisect_right(_STARTS, ptr) - 1
    return i >= 0 and ptr + nbytes <= _REGIONS[_STARTS[i]]


_MINCORE_PAGES = 4096  # pages asked of mincore at once: one vector of this many bytes, whatever the range
try:  # mincore(2), typed; None where the C library has none
    _mincore: Any = ctypes.CDLL(None, use_errno=True).mincore
    _mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    _mincore.restype = ctypes.c_int
except (OSError, AttributeError):
    _mincore = None


def mapped(ptr: int, nbytes: int) -> bool:
    """Whether every page of [ptr, ptr + nbytes) is mapped in this process (mincore(2) fails with ENOMEM on a page no
    mapping holds): reading an address of another process, or of memory since unmapped, would kill this one. Asked
    16 MiB at a time, ending at the first page not mapped. True where that cannot be told (no mincore, or it fails
    otherwise). Whether the pages may be read or written is not told (`access_fault` tells)."""
    if nbytes <= 0 or _mincore is None:
        return True
    page = mmap.PAGESIZE
    start, end = ptr - ptr % page, ptr + nbytes
    vec = ctypes.create_string_buffer(_MINCORE_PAGES)
    while start < end:
        length = min(end - start, _MINCORE_PAGES * page)
        if _mincore(start, length, vec) != 0:
            return ctypes.get_errno() != errno.ENOMEM
        start += length
    return True


# The last reading of /proc/self/maps: the mappings' starts, and each mapping's (start, end, readable, writable), by
# start; published as one pair, so that a thread reading it while another reads the maps again sees one reading whole.
# Read again only when a range is not found there with the access asked: a program's own memory (its heap, its arrays)
# is found at once, for a bisect. A mapping whose protection changed since it was read (mprotect, or one unmapped and
# another mapped at its address) is judged as it was then; `mapped` is asked first, so one unmapped since is not.
_Maps = tuple[list[int], list[tuple[int, int, bool, bool]]]
_MAPPINGS: _Maps = ([], [])
_MAPS_LINE = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) (.)(.)", re.MULTILINE)
_NOT_ITS_MEMORY = ("is not all memory of this process (an address of another process, memory freed since, or a count "
                   "past its end)")


def _read_maps() -> _Maps | None:
    """/proc/self/maps read again, published as _MAPPINGS; None where it cannot be read (no /proc). A page that may be
    written may be read (x86, arm64)."""
    global _MAPPINGS
    try:
        with open("/proc/self/maps", "rb") as f:
            data = f.read()
    except OSError:
        return None
    maps = sorted((int(lo, 16), int(hi, 16), r == b"r" or w == b"w", w == b"w")
                  for lo, hi, r, w in _MAPS_LINE.findall(data))
    _MAPPINGS = reading = ([m[0] for m in maps], maps)
    return reading


def _first_fault(ptr: int, end: int, write: bool, reading: _Maps) -> tuple[int, str] | None:
    """The first address of [ptr, end) that `reading` (of the maps) gives no mapping with the access asked, and what is
    there ("unmapped", "no access" or "read-only"); None when every byte may be accessed."""
    starts, maps = reading
    i = bisect.bisect_right(starts, ptr) - 1
    at = ptr
    while at < end:
        if i < 0 or maps[i][1] <= at:
            i += 1  # `at` lies past mapping i: it is in the next one, or in none
            if i >= len(maps) or maps[i][0] > at:
                return at, "unmapped"
            continue
        _, hi, readable, writable = maps[i]
        if not (writable if write else readable):
            return at, "read-only" if readable else "no access"
        at = hi
        i += 1
        if at < end and (i >= len(maps) or maps[i][0] != at):
            return at, "unmapped"
    return None


def access_fault(ptr: int, nbytes: int, write: bool = False) -> str | None:
    """Why reading (or, with `write`, writing) [ptr, ptr + nbytes) would kill this process, in words that follow "its
    range of N B at 0x...": the first page out of reach; None when every byte may be accessed, or where that cannot be
    told (no /proc). Unmapped pages are found by `mapped` (mincore); pages mapped without the access (a PROT_NONE
    reservation such as a GPU driver's address range or a guard page, or a read-only mapping written to) from
    /proc/self/maps. A count that runs past an array into other memory of the process is not told apart."""
    if nbytes <= 0:
        return None
    if not mapped(ptr, nbytes):
        return _NOT_ITS_MEMORY
    end = ptr + nbytes
    if _first_fault(ptr, end, write, _MAPPINGS) is None:
        return None
    reading = _read_maps()
    fault = None if reading is None else _first_fault(ptr, end, write, reading)
    if fault is None or fault[1] == "unmapped":
        # NOTE: mincore found every page mapped: a page the maps lack was mapped after a reading taken in parts
        # while other threads map memory; not told apart, as where /proc cannot be read
        return None
    at, what = fault
    if what == "no access":
        return (f"has memory mapped without access at {at:#x} ({at - ptr} B in): a reservation such as a GPU's "
                "device memory, a guard page, or an allocator's unused reserve")
    return f"has read-only memory at {at:#x} ({at - ptr} B in), which this rank may not write"


def _view_of(ptr: int, nbytes: int) -> np.ndarray:
    """A u8 view of [ptr, ptr + nbytes) for a twin, judged first in a rank (where regions are registered): a range
    past a region's end (check_range), or memory outside every region that this process may not read, is a
    UsageError rather than a silent overrun or a SIGSEGV; memory it may read but not write gives a read-only view
    (a write to it raises ValueError)."""
    writable = True
    if _REGIONS:
        if not 4096 <= ptr < 2**64 - nbytes:
            from tray.errors import UsageError

            raise UsageError(f"a kernel twin's view of {nbytes} B at {ptr:#x} is no memory (nothing is ever mapped "
                             "below 4096; addresses are < 2**64): pass a buffer's address from the manifest's args")
        check_range(ptr, nbytes)
        if not in_region(ptr, nbytes) and access_fault(ptr, nbytes, write=True) is not None:
            fault = access_fault(ptr, nbytes)
            if fault is not None:
                from tray.errors import UsageError

                raise UsageError(f"a kernel twin's view of {nbytes} B at {ptr:#x} {fault}: a kernel's argument is "
                                 "an address this rank may not touch (an offset past its buffer, or another "
                                 "process's address); on a GPU this would fault or corrupt memory")
            writable = False
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
    if not writable:
        raw.flags.writeable = False
    return raw


def at(ptr: int, count: int, dtype: Any) -> np.ndarray:
    """A typed view of `count` elements of `dtype` at address `ptr` (no copy; empty when count <= 0)."""
    dt = np.dtype(dtype)
    count = int(count)  # a numpy integer (np.uint64, as a kernel's count may be) is the int it holds
    if count <= 0:
        return np.zeros(0, dt)
    return _view_of(int(ptr), count * dt.itemsize).view(dt)


def u32_at(ptr: int, count: int) -> np.ndarray:
    """A u32 view of `count` words at `ptr` (no copy)."""
    return at(ptr, count, np.uint32)


def u64_at(ptr: int, count: int) -> np.ndarray:
    """A u64 view of `count` words at `ptr` (no copy)."""
    return at(ptr, count, np.uint64)


def f32_at(ptr: int, count: int) -> np.ndarray:
    """A float32 view of `count` elements at `ptr` (no copy)."""
    return at(ptr, count, np.float32)
