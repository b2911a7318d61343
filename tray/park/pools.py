"""The page pools of one rank: per manifest state a device pool and a host tier in one pinned host pool.

Device pool: one buffer of `pages * page_nbytes` (not exported), page i at `ptr + i * page_nbytes`.
Host tier: `host_pages * page_nbytes` inside the rank's single pinned host allocation (one per rank,
made once), page i at `host_base + i * page_nbytes`. Both hand out page ids through a PageAllocator.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from tray.backend.base import Backend, DeviceBuffer, HostMemory
from tray.manifest import ResolvedState
from tray.numa.pool import Placement, check_placement
from tray.park.pages import PageAllocator

DEVICE_PREFIX = "tray:state:"
# NOTE: each host tier starts on a 2 MiB boundary of the pool: huge-page and DMA friendly, and a
# tier's pages never share a base page with another tier's.
HOST_TIER_ALIGN = 2 << 20


def _align(nbytes: int, granule: int) -> int:
    return -(-nbytes // granule) * granule


@dataclass(frozen=True)
class HostLayout:
    """Where each state's host tier sits in the pool: byte offsets, and the pool's total size."""

    offsets: dict[str, int]
    nbytes: int


def host_layout(states: Sequence[ResolvedState]) -> HostLayout:
    """Tiers in manifest order, each aligned to HOST_TIER_ALIGN; states with host_pages 0 take no room."""
    offsets: dict[str, int] = {}
    end = 0
    for s in states:
        offsets[s.name] = _align(end, HOST_TIER_ALIGN)
        end = offsets[s.name] + s.host_nbytes
    return HostLayout(offsets, end)


class StatePool:
    """One state on one rank: its device pool and its host tier, and who holds which page."""

    def __init__(self, spec: ResolvedState, device: DeviceBuffer, host_base: int) -> None:
        self.spec = spec
        self.name = spec.name
        self.page_nbytes = spec.page_nbytes
        self.device = device
        self.host_base = host_base
        self.device_pages = PageAllocator(spec.pages)
        self.host_pages = PageAllocator(spec.host_pages)

    def device_ptr(self, page: int) -> int:
        """Device address of device page `page`."""
        return self.device.ptr + page * self.page_nbytes

    def host_ptr(self, page: int) -> int:
        """Host address of host-tier page `page`."""
        return self.host_base + page * self.page_nbytes

    @property
    def host_nbytes(self) -> int:
        return self.spec.host_nbytes

    @property
    def device_nbytes(self) -> int:
        return self.spec.nbytes

    def __repr__(self) -> str:
        d, h = self.device_pages, self.host_pages
        return (
            f"StatePool({self.name!r}, device {d.free_count}/{d.npages} pages free, "
            f"host {h.free_count}/{h.npages} free, page {self.page_nbytes} B)"
        )


class RankPools:
    """Every state's pool on this rank plus the one pinned host pool. `close()` frees both kinds."""

    def __init__(self, backend: Backend, states: Sequence[ResolvedState], rank: int) -> None:
        self.layout = host_layout(states)
        self.host: HostMemory | None = None
        self.placement = Placement(-1)
        self.states: dict[str, StatePool] = {}
        made: list[DeviceBuffer] = []
        try:
            if self.layout.nbytes:
                self.host = backend.pinned_host(self.layout.nbytes)
            host_ptr = self.host.ptr if self.host is not None else 0
            for s in states:
                buf = backend.allocate(DEVICE_PREFIX + s.name, s.nbytes, export=False)
                made.append(buf)
                self.states[s.name] = StatePool(s, buf, host_ptr + self.layout.offsets[s.name])
        except BaseException:
            for buf in made:
                buf.close()
            if self.host is not None:
                self.host.close()
            raise
        self._check_numa(backend, rank)

    def _check_numa(self, backend: Backend, rank: int) -> None:
        """Where the host pool's pages sit; a warning (not an error) when they are off the GPU's node."""
        if self.host is None:
            return
        found = getattr(self.host, "placement", None)  # the cuda backend checks when it allocates
        node = backend.info.numa_node
        if isinstance(found, Placement) and found.expected >= 0:
            self.placement = found
        elif node >= 0:
            self.placement = check_placement(self.host.ptr, self.host.nbytes, node)
        if not self.placement.ok:
            print(
                f"tray: rank {rank}: pinned host pool is not on the GPU's NUMA node "
                f"({self.placement.describe()}); park/wake will cross the socket link",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        for pool in self.states.values():
            pool.device.close()
        if self.host is not None:
            self.host.close()
            self.host = None
