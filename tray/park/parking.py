"""Tray-wide park and wake (docs/design.md section 8): two votes through the head, all or nothing.

park, on every rank at once:
  1. room     reserve host-tier pages for the session's pages (none if it already holds a host copy)
              and vote {room, free, need}. Any rank without room (or any misuse, or ranks that name
              different sessions): every rank drops its reservation and raises; no byte moved anywhere.
  2. landed   copy the dirty pages (contiguous runs folded into one copy each, on the transfer
              stream), wait for them, vote landed. Only when every rank landed do the device pages go
              back to the pool; if any copy failed, every rank keeps its session live on the device.
wake is the same with device pages leased in step 1 and host -> device copies in step 2; the session
is handed out only when every rank's pages landed.

Every park and every wake makes exactly two exchanges on every rank, whatever happens, so the
ranks' exchange sequences never drift apart.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from tray.errors import DeviceError, NoRoom, UsageError
from tray.handshake.steps import PARK_TOPIC
from tray.manifest import ResolvedState
from tray.manifest.expr import did_you_mean
from tray.numa.pool import Placement
from tray.park.pages import fold_runs
from tray.park.pools import RankPools, StatePool
from tray.park.session import ParkedSession, ParkStats, Session, SessionRecord, Where
from tray.rank.wiring import RankContext
from tray.text import ranks_text

TOPIC = PARK_TOPIC
# NOTE: the room vote waits only for every rank to reach the call; a minute covers a rank that is
# still finishing a program step. The landed vote also waits for the slowest rank's copy, at no less
# than 1 GB/s (pinned copies run at 35-55 GB/s on the machines we test on).
VOTE_TIMEOUT_S = 60.0
SLOWEST_COPY_BPS = 1e9


def disagreement(op: str, votes: Sequence[dict[str, Any]]) -> str | None:
    """Why the room votes of `op` ("park" | "wake") cannot go on, or None: a rank reported misuse, or
    the ranks are not all doing the same operation on the same session of the same state."""
    errors = [(r, v["error"]) for r, v in enumerate(votes) if v.get("error")]
    if errors:
        said = "; ".join(f"rank {r}: {e}" for r, e in errors)
        return f"{op}: {said}; nothing moved on any rank"
    groups: dict[tuple[str, int, str], list[int]] = {}
    for r, v in enumerate(votes):
        groups.setdefault((v["op"], v["session"], v["state"]), []).append(r)
    if len(groups) == 1:
        return None
    parts = [
        f"{ranks_text(rs)} {o}{'s' if len(rs) == 1 else ''} session {s} of state {st!r}"
        for (o, s, st), rs in groups.items()
    ]
    return (
        f"{op}: the ranks disagree: {', '.join(parts)}; every rank must {op} the same session together "
        "(session ids count each rank's leases: lease once per session on every rank, 0 pages is fine); "
        "nothing moved on any rank"
    )


def shortage(op: str, votes: Sequence[dict[str, Any]]) -> str | None:
    """The NoRoom message if any rank voted no room, else None."""
    short = [(r, v) for r, v in enumerate(votes) if not v["room"]]
    if not short:
        return None
    where = "host pool" if op == "park" else "device pool"
    state = short[0][1]["state"]
    said = "; ".join(
        f"rank {r} {where} has {v['free']} of {v['total']} pages free, session {v['session']} "
        f"needs {v['need']}"
        for r, v in short
    )
    if op == "park":
        advice = (
            f"release sessions that hold host pages of state {state!r}: a parked one (parked.release()), or a woken "
            "one, whose host copy stays reserved until it is released (session.release()); or give the state more "
            "host_pages in the manifest; then park again"
        )
    else:
        advice = (
            f"release or park live sessions of state {state!r} on {ranks_text([r for r, _ in short])}, "
            "then wake again"
        )
    return f"{op}: {said}; nothing moved on any rank; {advice}"


class Parking:
    """Park/wake of one rank. `Rank` builds it on first use (`rank.lease/park/wake`).

    It uses of the rank (`ctx`, a RankContext): `rank`, `world_size`, `backend`, `resolved` (the
    ResolvedManifest), `exchange(topic, value, timeout_s)` and `phases` (the head sees park/wake as the
    rank's phase). The pools (device buffers, one pinned host pool) are made at the first lease.
    `stats` counts what this rank copied.
    """

    def __init__(self, ctx: RankContext, timeout_s: float = VOTE_TIMEOUT_S) -> None:
        self._ctx = ctx
        self.rank: int = ctx.rank
        self.world_size: int = ctx.world_size
        self.backend = ctx.backend
        self.timeout_s = timeout_s
        self._specs: dict[str, ResolvedState] = {s.name: s for s in ctx.resolved.states}
        self._pools: RankPools | None = None
        self._records: dict[int, SessionRecord] = {}  # sessions not released
        self._next_id = 0
        self.stats = ParkStats()
        self.closed = False

    # --- pools ----------------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self.closed:
            raise UsageError(f"{what}: rank {self.rank}'s park pools are closed (rank.close() ran)")

    def _state(self, state: str | None, what: str) -> ResolvedState:
        if state is None:
            if len(self._specs) == 1:
                return next(iter(self._specs.values()))
            if not self._specs:
                raise UsageError(
                    f'{what}: the manifest declares no states; add one, e.g. "states": '
                    '[{"name": "kv", "page_nbytes": 2097152, "pages": 64}]'
                )
            raise UsageError(
                f"{what}: the manifest declares states {', '.join(self._specs)}; name one: "
                f"rank.lease(pages, state={next(iter(self._specs))!r})"
            )
        if state not in self._specs:
            known = ", ".join(self._specs) or "none"
            raise UsageError(
                f"{what}: no state {state!r}; the manifest declares: {known}"
                f"{did_you_mean(state, list(self._specs))}"
            )
        return self._specs[state]

    def _ensure_pools(self) -> RankPools:
        if self._pools is None:
            self._pools = RankPools(self.backend, tuple(self._specs.values()), self.rank)
        return self._pools

    def pool(self, state: str | None = None) -> StatePool:
        """The device pool and host tier of `state` (default: the only state) on this rank; made now
        if no lease made them yet."""
        self._check_open("pool")
        return self._ensure_pools().states[self._state(state, "pool").name]

    @property
    def placement(self) -> Placement:
        """Where the pinned host pool's pages sit (checked once, when the pool was made)."""
        return self._pools.placement if self._pools is not None else Placement(-1)

    # --- lease and release (local) ------------------------------------------------------------------------
    def lease(self, pages: int, state: str | None = None) -> Session:
        """`pages` device pages of `state` on this rank (lowest free ids: contiguous in a fresh pool).

        Local: no other rank is asked. Raises NoRoom naming this rank and its free and needed pages
        when the device pool is short; UsageError for a bad count or state.
        """
        self._check_open("lease")
        spec = self._state(state, "lease")
        try:
            count = operator.index(pages)
        except TypeError:
            raise UsageError(f"lease: pages must be an int, got {type(pages).__name__}") from None
        if count < 0:
            raise UsageError(f"lease: pages must be >= 0, got {count}")
        pool = self._ensure_pools().states[spec.name]
        ids = pool.device_pages.allocate(count)
        if ids is None:
            free, total = pool.device_pages.free_count, pool.device_pages.npages
            hint = (
                "release or park a session and retry"
                if count <= total
                else f"more than the pool holds: raise pages of state {spec.name!r} in the manifest"
            )
            raise NoRoom(
                f"lease: rank {self.rank} device pool of state {spec.name!r} has {free} of {total} "
                f"pages free, {count} needed; {hint}"
            )
        self._next_id += 1
        record = SessionRecord(
            id=self._next_id, pool=pool, npages=count, device_pages=ids, dirty=[True] * count
        )
        self._records[record.id] = record
        return Session(self, record)

    def _release(self, record: SessionRecord) -> None:
        pool = record.pool
        if record.device_pages is not None:
            pool.device_pages.free(record.device_pages)
            record.device_pages = None
        if record.host_pages is not None:
            pool.host_pages.free(record.host_pages)
            record.host_pages = None
        record.where = Where.RELEASED
        record.generation += 1
        self._records.pop(record.id, None)

    # --- the tray-wide steps -------------------------------------------------------------------------------
    def _exchange(self, value: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        return list(self._ctx.exchange(TOPIC, value, timeout_s))

    def _room_vote(
        self,
        op: str,
        record: SessionRecord | None,
        error: str | None,
        room: bool,
        free: int,
        total: int,
        need: int,
        nbytes: int,
    ) -> list[dict[str, Any]]:
        return self._exchange(
            {
                "op": op,
                "session": record.id if record else -1,
                "state": record.pool.name if record else "",
                "error": error,
                "room": room,
                "free": free,
                "total": total,
                "need": need,
                "nbytes": nbytes,
            },
            self.timeout_s,
        )

    def _landed_vote(self, op: str, error: str | None, votes: Sequence[dict[str, Any]]) -> list[str | None]:
        slowest = max((v["nbytes"] for v in votes), default=0)
        landed = self._exchange(
            {"op": op + ".landed", "error": error}, self.timeout_s + slowest / SLOWEST_COPY_BPS
        )
        return [v["error"] for v in landed]

    def _copy(self, record: SessionRecord, to_host: bool) -> int:
        """Copy the session's dirty pages to its host pages (park) or every host page to its device
        pages (wake); contiguous runs fold into one copy. Waits until the copies landed; bytes copied."""
        pool = record.pool
        assert record.device_pages is not None and record.host_pages is not None
        if to_host:
            idx = [i for i, d in enumerate(record.dirty) if d]
            runs = fold_runs([record.device_pages[i] for i in idx], [record.host_pages[i] for i in idx])
        else:
            runs = fold_runs(record.host_pages, record.device_pages)
        nbytes = 0
        for run in runs:
            n = run.npages * pool.page_nbytes
            if to_host:
                self.backend.copy(pool.host_ptr(run.dst), pool.device_ptr(run.src), n, transfer=True)
            else:
                self.backend.copy(pool.device_ptr(run.dst), pool.host_ptr(run.src), n, transfer=True)
            nbytes += n
        self.stats.copies += len(runs)
        if runs:
            self.backend.sync_transfer()
        return nbytes

    def _failed(self, op: str, errors: Sequence[str | None], outcome: str) -> DeviceError | None:
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if not bad:
            return None
        said = ", ".join(f"rank {r} ({e})" for r, e in bad)
        return DeviceError(f"{op}: the copy failed on {said}; {outcome}")

    def park(self, session: Session) -> ParkedSession:
        """Tray-wide: move every rank's pages of `session` into its host tier, all or nothing.

        Call on every rank with the same session. Copies only the dirty pages (see Session). Raises
        NoRoom on every rank when any rank's host tier is short (nothing moved, the session stays
        live); UsageError on every rank when any rank misuses it (parks a parked, released or foreign
        session, or another session than the others); DeviceError on every rank when a copy failed
        (the session stays live everywhere). Returns the ParkedSession; `session` is then stale.
        """
        with self._ctx.phases.showing("park"):
            record, error = self._current(session, Session, "park", Where.DEVICE)
            reserved: tuple[int, ...] | None = None
            free = total = need = nbytes = 0
            room = True
            if record is not None:
                hp = record.pool.host_pages
                free, total = hp.free_count, hp.npages
                if record.host_pages is None:
                    need = record.npages
                    reserved = hp.allocate(need)
                    room = reserved is not None
                nbytes = record.dirty_count * record.pool.page_nbytes
            try:
                votes = self._room_vote("park", record, error, room, free, total, need, nbytes)
                self._raise_if_refused("park", votes)
                assert record is not None  # a rank with an error makes every rank raise above
                if reserved is not None:
                    record.host_pages = reserved
                copied = self._copy_and_land("park", record, votes,
                                             "the session stays live on the device on every rank")
            except BaseException:
                # nothing changes hands: the new host reservation goes back, the session stays live
                if record is not None and reserved is not None:
                    record.pool.host_pages.free(reserved)
                    if record.host_pages is reserved:
                        record.host_pages = None
                raise
            assert record.device_pages is not None
            record.pool.device_pages.free(record.device_pages)
            record.device_pages = None
            record.dirty = [False] * record.npages
            record.where = Where.HOST
            record.generation += 1
            self.stats.parks += 1
            self.stats.history.append(("park", record.id, copied))
            return ParkedSession(self, record)

    def _copy_and_land(self, op: str, record: SessionRecord, votes: Any, outcome: str) -> int:
        """Phase 2 of park/wake: copy this rank's pages, then vote landed. Returns the bytes copied;
        raises (on every rank) if any rank's copy failed, saying `outcome`."""
        local: Exception | None = None
        try:
            copied = self._copy(record, to_host=op == "park")
            if op == "park":
                self.stats.bytes_parked += copied
            else:
                self.stats.bytes_woken += copied
        except Exception as exc:
            local, copied = exc, 0
        errors = self._landed_vote(op, f"{type(local).__name__}: {local}" if local else None, votes)
        failed = self._failed(op, errors, outcome)
        if failed:
            raise failed from local
        return copied

    def wake(self, parked: ParkedSession) -> Session:
        """Tray-wide: lease device pages on every rank and copy the parked pages back, all or nothing.

        Call on every rank with the same parked session. The host copy stays reserved; every page is
        dirty afterwards, so the next park copies it unless the program declares it unchanged
        (Session.mark_clean). Raises NoRoom
        on every rank when any rank's device pool is short (nothing moved, `parked` stays parked);
        UsageError on misuse (waking twice, a released session, different sessions); DeviceError when
        a copy failed (`parked` stays parked everywhere). Returns the live Session.
        """
        with self._ctx.phases.showing("wake"):
            record, error = self._current(parked, ParkedSession, "wake", Where.HOST)
            leased: tuple[int, ...] | None = None
            free = total = need = nbytes = 0
            room = True
            if record is not None:
                dp = record.pool.device_pages
                free, total, need = dp.free_count, dp.npages, record.npages
                leased = dp.allocate(need)
                room = leased is not None
                nbytes = need * record.pool.page_nbytes
            try:
                votes = self._room_vote("wake", record, error, room, free, total, need, nbytes)
                self._raise_if_refused("wake", votes)
                assert record is not None and leased is not None
                record.device_pages = leased
                copied = self._copy_and_land("wake", record, votes, "the session stays parked on every rank")
            except BaseException:
                # nothing changes hands: the new device lease goes back, the session stays parked
                if record is not None and leased is not None:
                    record.pool.device_pages.free(leased)
                    if record.device_pages is leased:
                        record.device_pages = None
                raise
            # Every page counts as written from here on: the program may write any of them without
            # telling us, and a park must never hand back an older copy. mark_clean() opts out.
            record.dirty = [True] * record.npages
            record.where = Where.DEVICE
            record.generation += 1
            self.stats.wakes += 1
            self.stats.history.append(("wake", record.id, copied))
            return Session(self, record)

    @staticmethod
    def _raise_if_refused(op: str, votes: Sequence[dict[str, Any]]) -> None:
        """UsageError (misuse, disagreement) or NoRoom (a rank short of pages) on every rank alike."""
        problem = disagreement(op, votes)
        if problem:
            raise UsageError(problem)
        short = shortage(op, votes)
        if short:
            raise NoRoom(short)

    def _current(
        self, handle: Any, kind: type, op: str, where: Where
    ) -> tuple[SessionRecord | None, str | None]:
        """The record behind `handle` if it may be used for `op` here, else (None, why not)."""
        want = (
            "a Session (from rank.lease or rank.wake)"
            if kind is Session
            else "a ParkedSession (from rank.park)"
        )
        if self.closed:
            return None, f"rank {self.rank}'s park pools are closed (rank.close() ran)"
        if not isinstance(handle, kind):
            got = type(handle).__name__
            hint = (
                "; to wake it, call rank.wake"
                if isinstance(handle, ParkedSession) and op == "park"
                else "; it is live already"
                if isinstance(handle, Session) and op == "wake"
                else ""
            )
            return None, f"{op} expects {want}, got {got}{hint}"
        checked: Any = handle  # a Session or a ParkedSession, as `kind` says
        if checked.parking is not self:
            return None, f"{op}: that session belongs to another tray's park pools"
        try:
            record: SessionRecord = checked._live(op) if kind is Session else checked._parked(op)
        except UsageError as exc:  # its message starts with "{op}: "; the vote adds "{op}: rank R: "
            return None, str(exc).removeprefix(f"{op}: ")
        assert record.where is where
        return record, None

    # --- ending -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the pools; every handle becomes unusable. Sessions are not parked on the way out."""
        if self.closed:
            return
        self.closed = True
        for record in list(self._records.values()):
            record.where = Where.RELEASED
            record.generation += 1
        self._records.clear()
        if self._pools is not None:
            self._pools.close()
            self._pools = None
