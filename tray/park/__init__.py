"""State pages, leases, the host tier, and tray-wide park/wake (docs/design.md section 8).

    session = rank.lease(64)                 # 64 device pages of the manifest's state, on this rank
    backend.write(session.ptr(0), data)      # page addresses; session.touch() marks pages written
    parked = rank.park(session)              # every rank at once: to pinned host memory, all or nothing
    session = rank.wake(parked)              # every rank at once: back to device pages
    session.release()

`Rank` builds one `Parking` per rank on first use; `pages.py` is the pure page allocator.
"""

from __future__ import annotations

from tray.park.pages import CopyRun, PageAllocator, fold_runs, page_runs
from tray.park.parking import Parking
from tray.park.session import ParkedSession, ParkStats, Session

__all__ = [
    "CopyRun",
    "PageAllocator",
    "ParkStats",
    "ParkedSession",
    "Parking",
    "Session",
    "fold_runs",
    "page_runs",
]
