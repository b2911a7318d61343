"""NUMA-local host pools: where the pages of a host allocation really sit (move_pages(2), query mode).

Ranks are bound to their GPU's node with MPOL_PREFERRED at exec (tray/numa/__init__.py), so pinned
memory they allocate should land there; "preferred" may fall back to another node when the node is
full, silently. `pages_on_node` asks the kernel; `check_placement` turns the answer into a verdict.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from dataclasses import dataclass, field

# NOTE: move_pages(2) syscall numbers; the libc wrapper lives in libnuma, which is not always there.
_SYS_MOVE_PAGES = {"x86_64": 279, "aarch64": 239}
# NOTE: a 140 GiB pool has 36 M base pages; asking about every one would cost 430 MB of arrays and
# seconds of kernel time. An even sample of this many pages tells a misplaced pool just as well.
DEFAULT_MAX_SAMPLES = 65536
_BATCH = 16384

_libc: ctypes.CDLL | None = None


def _syscall() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc


def pages_on_node(ptr: int, nbytes: int, max_samples: int = DEFAULT_MAX_SAMPLES) -> dict[int, int]:
    """How many base pages of [ptr, ptr + nbytes) sit on each NUMA node: {node: count}.

    At most `max_samples` pages, evenly spread, are asked about (all of them when fewer). Negative keys
    count pages the kernel could not place, as -errno: -ENOENT (-2) for pages never touched (no
    physical page yet), -EFAULT (-14) for addresses not mapped. {} when move_pages(2) is unavailable
    (another architecture, or a sandbox that refuses the call) or `nbytes` is 0.
    """
    nr = _SYS_MOVE_PAGES.get(os.uname().machine)
    if nr is None or nbytes <= 0 or ptr <= 0:
        return {}
    page = mmap.PAGESIZE
    first = ptr - ptr % page
    npages = (ptr + nbytes - first + page - 1) // page
    count = min(npages, max(1, max_samples))
    # evenly spread, always including the first and the last page
    addrs = (
        [first + (i * (npages - 1) // max(1, count - 1)) * page for i in range(count)]
        if count > 1
        else [first]
    )
    libc = _syscall()
    out: dict[int, int] = {}
    for lo in range(0, len(addrs), _BATCH):
        batch = addrs[lo : lo + _BATCH]
        pages = (ctypes.c_void_p * len(batch))(*batch)
        status = (ctypes.c_int * len(batch))()
        # move_pages(pid 0 = self, count, pages, nodes NULL = query only, status, flags 0)
        rc = libc.syscall(
            ctypes.c_long(nr),
            ctypes.c_int(0),
            ctypes.c_ulong(len(batch)),
            pages,
            None,
            status,
            ctypes.c_int(0),
        )
        if rc != 0:
            return {}
        for s in status:
            out[s] = out.get(s, 0) + 1
    return out


@dataclass(frozen=True)
class Placement:
    """The verdict on one host allocation. `expected` -1: no node to check against (always `ok`).

    `pages` is pages_on_node's answer ({} when the kernel cannot be asked: `checked` is False then).
    """

    expected: int
    pages: dict[int, int] = field(default_factory=dict)

    @property
    def checked(self) -> bool:
        return bool(self.pages)

    @property
    def on_node(self) -> int:
        return self.pages.get(self.expected, 0)

    @property
    def elsewhere(self) -> dict[int, int]:
        """Pages on other nodes (negative keys: not placed, see pages_on_node)."""
        return {n: c for n, c in self.pages.items() if n != self.expected and n != -errno.ENOENT}

    @property
    def ok(self) -> bool:
        """True unless some placed page sits off the expected node (untouched pages do not count)."""
        return self.expected < 0 or not self.checked or not {n for n in self.elsewhere if n >= 0}

    def describe(self) -> str:
        if self.expected < 0:
            return "no NUMA node to check against"
        if not self.checked:
            return f"expected node {self.expected}; move_pages(2) is unavailable here, not checked"
        sampled = sum(self.pages.values())
        where = ", ".join(
            f"node {n}: {c}" if n >= 0 else f"{errno.errorcode.get(-n, n)}: {c}"
            for n, c in sorted(self.pages.items())
        )
        return f"expected node {self.expected}; {sampled} pages sampled ({where})"


def check_placement(
    ptr: int, nbytes: int, expected_node: int, max_samples: int = DEFAULT_MAX_SAMPLES
) -> Placement:
    """Where [ptr, ptr + nbytes) sits, judged against `expected_node` (-1: nothing to judge)."""
    if expected_node < 0:
        return Placement(expected_node)
    return Placement(expected_node, pages_on_node(ptr, nbytes, max_samples))
