"""bench/nccl_lifecycle.py's pure parts: medians with a process's first communicator apart; the close's timeline
from NCCL's stamped INFO lines."""

from __future__ import annotations

from pathlib import Path

import pytest


def _bench():
    import importlib.util
    import sys as _sys

    path = Path(__file__).resolve().parents[2] / "bench" / "nccl_lifecycle.py"
    spec = importlib.util.spec_from_file_location("nccl_lifecycle", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    _sys.modules["nccl_lifecycle"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_nccl_lifecycle_bench_keeps_a_process_first_communicator_apart() -> None:
    mod = _bench()
    rounds = [[{"init_s": 0.9, "close_s": 0.5}, {"init_s": 0.3, "close_s": 0.4}, {"init_s": 0.5, "close_s": 0.6}],
              [{"init_s": 0.7, "close_s": 0.5}, {"init_s": 0.4, "close_s": 0.4}, {"init_s": 0.2, "close_s": 0.2}]]
    out = mod.summarize(rounds)
    assert out["first"] == {"init_s": 0.8, "close_s": 0.5}
    assert out["later"]["init_s"] == pytest.approx(0.35) and out["later"]["close_s"] == pytest.approx(0.4)
    assert "later" not in mod.summarize([[{"init_s": 1.0, "close_s": 1.0}]])


def test_the_close_timeline_places_nccls_stamped_lines_after_the_close_began() -> None:
    mod = _bench()
    notes = ["[1700000000.950000] vm:7:9 [0] NCCL INFO [Proxy Service UDS] exit: stop 0 abortFlag 0",  # before: out
             "[1700000001.480000] vm:7:9 [0] NCCL INFO [Proxy Service UDS] exit: stop 1 abortFlag 0",
             "[1700000001.010500] vm:7:8 [0] NCCL INFO [Service thread] Connection closed by localRank 0",
             "[1700000001.481000] vm:7:7 [0] NCCL INFO comm 0x5 rank 0 nranks 1 cudaDev 0 busId 1 - Destroy COMPLETE",
             "[garbled] NCCL INFO Destroy COMPLETE"]
    stamps = ["STAMP close-begin 1700000001.000000", "STAMP close-end 1700000001.482000"]
    got = [(e["ms"], e["event"]) for e in mod.close_timeline(notes, stamps)]
    assert got == [(10.5, "Connection closed by localRank"), (480.0, "[Proxy Service UDS] exit"),
                   (481.0, "Destroy COMPLETE"), (482.0, "close-end")]
    assert mod.close_timeline(notes, []) == []
