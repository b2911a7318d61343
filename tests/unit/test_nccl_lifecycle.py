"""bench/nccl_lifecycle.py's pure part: medians with a process's first communicator apart."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_the_nccl_lifecycle_bench_keeps_a_process_first_communicator_apart() -> None:
    import importlib.util
    import sys as _sys

    path = Path(__file__).resolve().parents[2] / "bench" / "nccl_lifecycle.py"
    spec = importlib.util.spec_from_file_location("nccl_lifecycle", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    _sys.modules["nccl_lifecycle"] = mod
    spec.loader.exec_module(mod)
    rounds = [[{"init_s": 0.9, "close_s": 0.5}, {"init_s": 0.3, "close_s": 0.4}, {"init_s": 0.5, "close_s": 0.6}],
              [{"init_s": 0.7, "close_s": 0.5}, {"init_s": 0.4, "close_s": 0.4}, {"init_s": 0.2, "close_s": 0.2}]]
    out = mod.summarize(rounds)
    assert out["first"] == {"init_s": 0.8, "close_s": 0.5}
    assert out["later"]["init_s"] == pytest.approx(0.35) and out["later"]["close_s"] == pytest.approx(0.4)
    assert "later" not in mod.summarize([[{"init_s": 1.0, "close_s": 1.0}]])
