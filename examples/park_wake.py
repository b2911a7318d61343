"""Park and wake a session: device pages to the host tier and back, tray-wide and all or nothing.

Run: tray launch -n 2 --backend host --manifest examples/park_wake.json examples/park_wake.py

A session is one lease of pages per rank. `rank.park(session)` is a tray-wide step (every rank calls it):
every rank first finds room in its host tier and votes; if any rank has no room, nobody moves a byte and
every rank gets NoRoom. `rank.wake(parked)` brings the pages back (maybe to other device pages).
"""

import numpy as np

import tray

with tray.init() as rank:
    me = rank.rank
    session = rank.lease(pages=8)  # 8 device pages of the manifest's only state, "kv"
    page_nbytes = session.page_nbytes
    backend = rank.backend  # read/write take device addresses: session.ptr(i) is page i's
    for i in range(session.npages):
        backend.write(session.ptr(i), np.full(page_nbytes, (me * 16 + i) % 251, np.uint8))
    before = [bytes(backend.read(session.ptr(i), page_nbytes)) for i in range(session.npages)]

    parked = rank.park(session)  # now on the host; `session` is stale (using it raises UsageError)
    try:
        rank.park(rank.lease(pages=9))  # 8 + 9 pages do not fit 16 host pages: refused everywhere
        raise AssertionError("the second park should not fit")
    except tray.NoRoom as exc:
        refused = str(exc)

    session = rank.wake(parked)  # back on device pages, every byte as it was
    after = [bytes(backend.read(session.ptr(i), page_nbytes)) for i in range(session.npages)]
    assert after == before
    print(f"rank {me}: parked and woke {session.npages} pages of {page_nbytes} B; the second park was "
          f"refused everywhere: {refused.splitlines()[0]}")
