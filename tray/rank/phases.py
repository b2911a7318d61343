"""A rank's phase clock: which phase it is in (on every heartbeat, so the head can name it) and how
long each timed phase took."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Protocol


class _PhaseSink(Protocol):
    phase: str


class PhaseClock:
    """The current phase and `timings` {phase: seconds}. `sink` (the rendezvous client) carries the
    phase on its heartbeats; None before it exists."""

    def __init__(self, sink: _PhaseSink | None = None, phase: str = "start") -> None:
        self.sink = sink
        self.current = phase
        self.timings: dict[str, float] = {}

    def enter(self, phase: str) -> None:
        """Show `phase` from now on (heartbeats included)."""
        self.current = phase
        if self.sink is not None:
            self.sink.phase = phase

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Enter `phase` and record its duration in `timings[phase]` (seconds), also when it raises."""
        self.enter(phase)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] = time.perf_counter() - t0

    @contextlib.contextmanager
    def showing(self, phase: str) -> Iterator[None]:
        """Show `phase` for the duration of the block, then the phase before it (untimed)."""
        before = self.current
        self.enter(phase)
        try:
            yield
        finally:
            self.enter(before)
