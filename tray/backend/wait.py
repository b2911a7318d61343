"""Bounded host waits for the device: poll a completion query with a deadline instead of blocking in the
driver forever (pure Python: the query is passed in, so the host tests drive it with fakes).

A blocking cuStreamSynchronize on a stream whose NCCL kernel waits for a peer that never comes never
returns; the rank then shows nothing. Here the query is polled back to back for the first SPIN_S (short
waits, e.g. a barrier then a sync, end within a query's time, as a spinning cuStreamSynchronize would),
then between sleeps that grow from FIRST_SLEEP_S to MAX_SLEEP_S (long waits cost little CPU and end at
most about MAX_SLEEP_S late).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from tray.errors import SyncTimeout, UsageError

SYNC_TIMEOUT_ENV = "TRAY_SYNC_TIMEOUT_S"
# NOTE: generous: the longest single wait in the benches (EP1's experts at 4096 tokens, a cold cuBLAS
# load before it) is seconds; a hang is minutes.
DEFAULT_SYNC_TIMEOUT_S = 60.0
# NOTE: measured on the 2-core CPU host: a wait that returns at once costs ~0.1 us over the query itself;
# a sleep lasts at least ~60 us, so a first sleep after 30 us of work returned 60 us late. Spinning for
# the first 2 ms keeps short waits exact; past it a wait ends at most ~MAX_SLEEP_S (+ the OS's slack) late.
SPIN_S = 2e-3
FIRST_SLEEP_S = 5e-5
MAX_SLEEP_S = 5e-4


def sync_timeout_s() -> float:
    """The deadline of host waits: `TRAY_SYNC_TIMEOUT_S` (seconds, > 0), else DEFAULT_SYNC_TIMEOUT_S.
    Raises UsageError for a value that is not a positive number."""
    raw = os.environ.get(SYNC_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_SYNC_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise UsageError(f"{SYNC_TIMEOUT_ENV} must be a positive, finite number of seconds, got {raw!r}")
    return value


class Pending:
    """What was last enqueued on a rank's stream, in words (`last`), for the message of a wait that timed
    out. `note` is on hot paths: one attribute store (the words are made once, not per call), plus an
    append while a capture records what its graph holds."""

    __slots__ = ("last", "_trail")

    def __init__(self) -> None:
        self.last = "nothing recorded"
        self._trail: list[str] | None = None

    def note(self, text: str) -> None:
        self.last = text
        if self._trail is not None and (not self._trail or self._trail[-1] != text):
            self._trail.append(text)

    def start_trail(self) -> None:
        """Start collecting every note (a capture begins)."""
        self._trail = []

    def end_trail(self) -> list[str]:
        """The notes since start_trail (repeats in a row kept once); stops collecting."""
        trail, self._trail = self._trail or [], None
        return trail


def wait_until(done: Callable[[], bool], what: str, pending: Pending | None = None,
               timeout_s: float | None = None, *, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep, spin_s: float = SPIN_S) -> None:
    """Return once `done()` is true; raise SyncTimeout (naming `what` and `pending.last`) when it is still
    false `timeout_s` (None: sync_timeout_s()) after the first check. `done` raising propagates (a failed
    query is a device error, not a timeout). Already done: one call of `done`, nothing else."""
    if done():
        return
    limit = sync_timeout_s() if timeout_s is None else timeout_s
    start = clock()
    while clock() - start < min(spin_s, limit):
        if done():
            return
    pause = FIRST_SLEEP_S
    while True:
        sleep(pause)
        if done():
            return
        waited = clock() - start
        if waited >= limit:
            # NOTE: one last look: a wait that ends at the deadline is not a hang
            if done():
                return
            raise SyncTimeout(what, pending.last if pending is not None else "not recorded", waited,
                              f"{SYNC_TIMEOUT_ENV} (now {limit:g} s)")
        pause = min(MAX_SLEEP_S, pause * 2)
