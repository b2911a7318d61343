"""Sessions as the caller holds them: `Session` (pages live on the device) and `ParkedSession` (on host).

Both are handles onto one record per session that the rank's `Parking` owns. Every park or wake makes
the previous handle stale, so a handle can only be used in the state it was handed out in: waking a
parked session twice, or writing through a session that was parked, is a UsageError, not a silent
read of pages that now belong to someone else.
"""

from __future__ import annotations

import enum
import operator
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from tray.errors import UsageError
from tray.park.pools import StatePool

if TYPE_CHECKING:
    from tray.park.parking import Parking


# NOTE: enough to debug the last steps of a server, bounded so a long-running one does not grow.
HISTORY_LEN = 256


class Where(enum.Enum):
    """Where a session's pages are. DEVICE -> HOST (park) -> DEVICE (wake); any -> RELEASED."""

    DEVICE = "live on the device"
    HOST = "parked on the host"
    RELEASED = "released"


@dataclass(eq=False)
class SessionRecord:
    """The state of one session on one rank (owned by Parking; handles point at it).

    `device_pages[i]` / `host_pages[i]` are the ids of the session's i-th page in the state's device
    pool / host tier (None: none held). `dirty[i]`: the device page is newer than its host copy (or it
    has none), so the next park must copy it. `generation` counts transitions; a handle is current
    while its generation matches.
    """

    id: int
    pool: StatePool
    npages: int
    device_pages: tuple[int, ...] | None
    dirty: list[bool]
    where: Where = Where.DEVICE
    host_pages: tuple[int, ...] | None = None
    generation: int = 0

    @property
    def dirty_count(self) -> int:
        return sum(self.dirty)


@dataclass
class ParkStats:
    """What this rank's park/wake did: counts of tray-wide operations that completed, bytes copied
    (device -> host on park, host -> device on wake) and copy calls (folded page runs)."""

    parks: int = 0
    wakes: int = 0
    bytes_parked: int = 0
    bytes_woken: int = 0
    copies: int = 0
    # the last HISTORY_LEN operations: (op, session id, bytes copied)
    history: deque[tuple[str, int, int]] = field(default_factory=lambda: deque(maxlen=HISTORY_LEN))

    @property
    def bytes_copied(self) -> int:
        return self.bytes_parked + self.bytes_woken


def _stale(kind: str, record: SessionRecord, what: str) -> UsageError:
    """The error for using a handle of `kind` ("session" | "parked") that is no longer current."""
    sid = record.id
    if record.where is Where.RELEASED:
        return UsageError(f"{what}: session {sid} was released; lease a new session (rank.lease)")
    if kind == "session" and record.where is Where.HOST:
        return UsageError(
            f"{what}: session {sid} is parked and its device pages went back to the pool; "
            "wake it first (session = rank.wake(parked)) and use the Session wake returns"
        )
    if kind == "session":
        return UsageError(
            f"{what}: this handle of session {sid} is stale: the session was parked and woken "
            "since; use the Session that rank.wake returned"
        )
    if record.where is Where.DEVICE:
        return UsageError(
            f"{what}: parked session {sid} was already woken; rank.wake returned its live "
            "Session (park that to park it again)"
        )
    return UsageError(
        f"{what}: this handle of parked session {sid} is stale: it was woken and parked again "
        "since; use the ParkedSession that the last rank.park returned"
    )


class _Handle:
    """What a live Session and a ParkedSession share: the record they point at, valid only while the
    record is still in the generation and place (`_WHERE`) the handle was given out for."""

    _WHERE: Where
    _KIND: str

    def __init__(self, parking: Parking, record: SessionRecord) -> None:
        self._parking = parking
        self._record = record
        self._generation = record.generation

    def _current(self, what: str) -> SessionRecord:
        self._parking._check_open(what)
        r = self._record
        if r.generation != self._generation or r.where is not self._WHERE:
            raise _stale(self._KIND, r, what)
        return r

    def _valid(self) -> bool:
        r = self._record
        return r.generation == self._generation and r.where is self._WHERE and not self._parking.closed

    @property
    def id(self) -> int:
        return self._record.id

    @property
    def state(self) -> str:
        return self._record.pool.name

    @property
    def parking(self) -> Parking:
        return self._parking

    @property
    def npages(self) -> int:
        return self._record.npages

    @property
    def nbytes(self) -> int:
        return self._record.npages * self._record.pool.page_nbytes


class Session(_Handle):
    """One rank's part of a tray-wide session: `npages` device pages of state `state`.

    `pages` are device page ids, `ptr(i)` the device address of the i-th page (`page_nbytes` bytes).
    The session id is the same on every rank: ranks number their leases in the order they make them,
    so every rank leases once per session (0 pages is fine) and parks/wakes sessions together.

    Dirty pages (what park copies): a page is dirty when its device bytes may differ from its host
    copy. Freshly leased pages are dirty, and so is every page after a wake (the program may write
    any of them): a park never returns older bytes than the device held. A program that knows which
    pages it left unchanged since the wake says so with `mark_clean(indices)` (or `mark_clean()` for
    all), and the next park copies only the others; `touch(indices)` marks pages dirty again.
    `release()` frees the device pages and the host copy.
    """

    _WHERE = Where.DEVICE
    _KIND = "session"

    def _live(self, what: str) -> SessionRecord:
        return self._current(what)

    @property
    def page_nbytes(self) -> int:
        return self._record.pool.page_nbytes

    @property
    def live(self) -> bool:
        """Whether this handle may be used (not parked, woken or released since it was handed out)."""
        return self._valid()

    @property
    def pages(self) -> tuple[int, ...]:
        """Device page ids, in session order (page i of the session is `pages[i]`)."""
        pages = self._live("session.pages").device_pages
        assert pages is not None  # a live session holds device pages
        return pages

    def ptr(self, i: int) -> int:
        """Device address of the session's i-th page (0 <= i < npages). UsageError out of range."""
        r = self._live("session.ptr")
        i = _index(i, r.npages, "session.ptr", r.id)
        assert r.device_pages is not None
        return r.pool.device_ptr(r.device_pages[i])

    def touch(self, page_indices: Iterable[int] | None = None) -> None:
        """Mark pages as written since the last park or wake (all pages when None): the next park
        copies them. Indices are session page indices (0..npages-1), not page ids."""
        r = self._live("session.touch")
        if page_indices is None:
            r.dirty = [True] * r.npages
            return
        idx = [_index(i, r.npages, "session.touch", r.id) for i in _iterable(page_indices, "session.touch")]
        for i in idx:
            r.dirty[i] = True

    def mark_clean(self, page_indices: Iterable[int] | None = None) -> None:
        """Declare pages unchanged since the last wake (all pages when None): the next park keeps
        their host copy instead of copying them. Only after a wake (a page with no host copy yet
        cannot be clean): UsageError otherwise. Indices are session page indices (0..npages-1)."""
        r = self._live("session.mark_clean")
        if r.host_pages is None:
            raise UsageError(f"session.mark_clean: session {r.id} was never parked, so its pages have no host "
                             "copy to keep; park it first")
        idx = range(r.npages) if page_indices is None else \
            [_index(i, r.npages, "session.mark_clean", r.id) for i in _iterable(page_indices, "session.mark_clean")]
        for i in idx:
            r.dirty[i] = False

    @property
    def dirty(self) -> tuple[int, ...]:
        """Indices of the pages the next park will copy."""
        r = self._live("session.dirty")
        return tuple(i for i, d in enumerate(r.dirty) if d)

    def release(self) -> None:
        """Give the device pages and the host copy (if any) back to this rank's pools. Local to this
        rank: release the session on every rank. UsageError if the session is parked or released."""
        self._parking._release(self._live("session.release"))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.release()

    def __repr__(self) -> str:
        r = self._record
        state = r.where.value if r.generation == self._generation else "stale handle"
        return f"Session(id={r.id}, state={r.pool.name!r}, npages={r.npages}, {state})"


class ParkedSession(_Handle):
    """One rank's part of a parked session: its pages sit in the host tier; no device page is held.

    `rank.wake(parked)` (on every rank) brings it back; `release()` frees the host pages instead.
    """

    _WHERE = Where.HOST
    _KIND = "parked"

    def _parked(self, what: str) -> SessionRecord:
        return self._current(what)

    @property
    def parked(self) -> bool:
        """Whether this handle may still be woken or released."""
        return self._valid()

    @property
    def host_pages(self) -> tuple[int, ...]:
        """Host-tier page ids, in session order."""
        pages = self._parked("parked.host_pages").host_pages
        assert pages is not None
        return pages

    def host_ptr(self, i: int) -> int:
        """Host address of the parked copy of the session's i-th page."""
        r = self._parked("parked.host_ptr")
        i = _index(i, r.npages, "parked.host_ptr", r.id)
        assert r.host_pages is not None
        return r.pool.host_ptr(r.host_pages[i])

    def release(self) -> None:
        """Free the host pages; the session is gone on this rank. Local: release it on every rank."""
        self._parking._release(self._parked("parked.release"))

    def __repr__(self) -> str:
        r = self._record
        state = r.where.value if r.generation == self._generation else "stale handle"
        return f"ParkedSession(id={r.id}, state={r.pool.name!r}, npages={r.npages}, {state})"


def _iterable(page_indices: object, what: str) -> Iterable[object]:
    """`page_indices` as given to touch/mark_clean: an iterable of indices; one index alone is a UsageError."""
    try:
        return iter(page_indices)  # type: ignore[call-overload]
    except TypeError:
        raise UsageError(f"{what}: page_indices is a list (any iterable) of session page indices, or None for "
                         f"all; got {type(page_indices).__name__} {repr(page_indices)[:60]}: pass [i] for one "
                         "page") from None


def _index(i: Any, npages: int, what: str, sid: int) -> int:
    try:
        k = operator.index(i)
    except TypeError:
        raise UsageError(f"{what}: page index must be an int, got {type(i).__name__}") from None
    if not 0 <= k < npages:
        raise UsageError(
            f"{what}: page index {k} is out of range for session {sid} of {npages} pages (0..{npages - 1})"
        )
    return k
