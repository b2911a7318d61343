"""Timing work in lockstep: every rank times the same body between the backend's timer marks.

Used by the EP MoE and TP benches. `us_per_call` captures a body (Python that enqueues ops, e.g.
`rank.run(...)` of programs whose plans are already built) K times into one graph, K agreed by every rank
so that the barriers and collectives inside stay paired; each sample is one replay between timer marks,
started right after an eager peer barrier so the ranks start together; the figure is the median sample
over K. `us_eager` times the same way without a graph: K bodies launched from Python between the marks
(it includes the host's launch cost wherever the device is faster than the host; benches label it).

With `log_path`, every figure is appended there as one JSON line the moment it is taken (label, timing,
us, reps, samples), so a run that hangs or dies later loses nothing measured before.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# NOTE: one replay of this many seconds amortises the replay's launch and the start skew between ranks.
DEFAULT_TARGET_S = 2e-3
MAX_REPS_PER_GRAPH = 64
TIMINGS = ("captured", "eager")


@dataclass
class Sampler:
    """Times bodies on `rank` (a tray.Rank). `target_s` sizes K (0: always one body per sample)."""

    rank: Any
    repeats: int = 10
    warmup: int = 2
    target_s: float = DEFAULT_TARGET_S
    group: str = "world"
    log_path: Path | None = None
    _timer: Any = field(default=None, init=False, repr=False)

    def _timed(self, launch: Callable[[], None]) -> float:
        """Seconds between timer marks around `launch`, started after an eager barrier of the group."""
        if self._timer is None:
            self._timer = self.rank.backend.timer()
        self.rank.barrier_of(self.group).launch()
        self._timer.start()
        launch()
        self._timer.stop()
        return float(self._timer.elapsed_s())

    def _agreed_reps(self, topic: str, t_one: float) -> int:
        """K bodies per sample, from the slowest rank's single-body time: the same on every rank."""
        slowest = max(self.rank.exchange(topic, t_one))
        if self.target_s > 0 and slowest > 0:
            return max(1, min(MAX_REPS_PER_GRAPH, round(self.target_s / slowest)))
        return 1

    def _log(self, label: str, timing: str, us: float, reps: int, samples: list[float]) -> None:
        if self.log_path is None:
            return
        line = {"label": label, "timing": timing, "us": us, "reps": reps, "samples_us": [s * 1e6 for s in samples],
                "at": time.time()}
        with open(self.log_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def us_per_call(self, body: Callable[[], None], label: str = "") -> float:
        """Median µs of one `body`, captured. Every rank of the group must call this in the same order."""
        backend = self.rank.backend
        body()  # eagerly once: plans, kernels and library handles are built outside the capture
        self.rank.synchronize()
        single = backend.capture(body)
        graphs = [single]
        try:
            self._timed(single.replay)  # warm: first replay uploads the graph
            reps = self._agreed_reps("tray.bench.timing", self._timed(single.replay))
            graph = single
            if reps > 1:
                graph = backend.capture(lambda: [body() for _ in range(reps)])
                graphs.append(graph)
            for _ in range(self.warmup):
                self._timed(graph.replay)
            samples = [self._timed(graph.replay) / reps for _ in range(self.repeats)]
            self.rank.synchronize()
        finally:
            for g in graphs:
                g.close()
        us = statistics.median(samples) * 1e6
        self._log(label, "captured", us, reps, samples)
        return us

    def us_eager(self, body: Callable[[], None], label: str = "") -> float:
        """Median µs of one `body` launched eagerly (no graph): K bodies back to back between the timer
        marks, after an eager barrier; K agreed as in us_per_call. Every rank of the group must call this
        in the same order. The figure includes the host's launch cost where the device waits for it."""
        body()  # plans and handles are built before anything is timed
        self.rank.synchronize()

        def one() -> None:
            body()

        self._timed(one)
        reps = self._agreed_reps("tray.bench.timing.eager", self._timed(one))

        def k_bodies() -> None:
            for _ in range(reps):
                body()

        for _ in range(self.warmup):
            self._timed(k_bodies)
        samples = [self._timed(k_bodies) / reps for _ in range(self.repeats)]
        self.rank.synchronize()
        us = statistics.median(samples) * 1e6
        self._log(label, "eager", us, reps, samples)
        return us

    def us(self, body: Callable[[], None], timing: str, label: str = "") -> float:
        """us_per_call (timing "captured") or us_eager ("eager"); ValueError for another timing."""
        if timing == "captured":
            return self.us_per_call(body, label)
        if timing == "eager":
            return self.us_eager(body, label)
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
