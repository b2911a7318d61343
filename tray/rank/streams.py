"""Programs on the caller's stream: `rank.run(program, stream=s)`.

The program's work stays on the rank's stream, forked from `s` and joined back with two events
(Backend.joined): it runs after what was enqueued on `s` before the call and before what is enqueued
after it. Inside a CUDA graph capture on `s` (e.g. `torch.cuda.graph`), the fork pulls the rank's stream
into that capture, so the program becomes part of the caller's graph; a program tray itself captured
(`graph: true`) is then recorded step by step instead of replaying tray's graph, so one capture holds
all of it. Nothing here allocates or synchronises.
"""

from __future__ import annotations

from typing import Any

from tray.backend.base import Backend


def run_on_stream(backend: Backend, plan: Any, stream: int) -> None:
    """Run `plan` (an executor Plan: `run_steps`, and `graph` when tray captured it) ordered with `stream`."""
    capturing = backend.is_capturing(stream)
    if plan.pending is not None:
        plan.pending.note(plan.describe)
    with backend.joined(stream):
        if plan.graph is not None and not capturing:
            plan.graph.replay()
        else:
            plan.run_steps()
