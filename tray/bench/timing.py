"""Timing captured work in lockstep: every rank replays the same graph between the backend's timer marks.

Used by the EP MoE and TP benches. A body (Python that enqueues ops, e.g. `rank.run(...)` of programs
whose plans are already built) is captured K times into one graph, K agreed by every rank so that the
barriers inside stay paired; each sample is one replay between timer marks, started right after an
eager peer barrier so the ranks start together; the figure is the median sample over K.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# NOTE: one replay of this many seconds amortises the replay's launch and the start skew between ranks.
DEFAULT_TARGET_S = 2e-3
MAX_REPS_PER_GRAPH = 64


@dataclass
class Sampler:
    """Times bodies on `rank` (a tray.Rank). `target_s` sizes K (0: always one body per graph)."""

    rank: Any
    repeats: int = 10
    warmup: int = 2
    target_s: float = DEFAULT_TARGET_S
    group: str = "world"
    _timer: Any = field(default=None, init=False, repr=False)

    def _one(self, graph: Any) -> float:
        backend = self.rank.backend
        if self._timer is None:
            self._timer = backend.timer()
        self.rank.barrier_of(self.group).launch()
        self._timer.start()
        graph.replay()
        self._timer.stop()
        return float(self._timer.elapsed_s())

    def us_per_call(self, body: Callable[[], None]) -> float:
        """Median µs of one `body`, captured. Every rank of the group must call this in the same order."""
        backend = self.rank.backend
        body()  # eagerly once: plans, kernels and library handles are built outside the capture
        self.rank.synchronize()
        single = backend.capture(body)
        graphs = [single]
        try:
            self._one(single)  # warm: first replay uploads the graph
            t_one = self._one(single)
            slowest = max(self.rank.exchange("tray.bench.timing", t_one))
            reps = 1
            if self.target_s > 0 and slowest > 0:
                reps = max(1, min(MAX_REPS_PER_GRAPH, round(self.target_s / slowest)))
            graph = single
            if reps > 1:
                graph = backend.capture(lambda: [body() for _ in range(reps)])
                graphs.append(graph)
            for _ in range(self.warmup):
                self._one(graph)
            samples = [self._one(graph) / reps for _ in range(self.repeats)]
            self.rank.synchronize()
            return statistics.median(samples) * 1e6
        finally:
            for g in graphs:
                g.close()
