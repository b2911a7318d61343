"""bench/ncu_summary.py reads Nsight Compute's text report into launches and their metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import ncu_summary

REPORT = """==PROF== Connected to process 533 (/usr/bin/python3.12)
  uniform_T8192    wgmma                w13+silu    3803.1  w2    1952.0  experts    5768.5 µs
  ep_wgmma_gemm_gather (16, 8, 128)x(384, 1, 1), Context 1, Stream 13, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    Elapsed Cycles                cycle    5,727,739
    Duration                         ms         3.83
    L2 Cache Throughput               %        97.79
    ----------------------- ----------- ------------

    INF   Compute and Memory are well-balanced: To reduce runtime, both computation and memory traffic must be reduced.
    Section: Launch Statistics
    Cluster Size                                                   0
  nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT (2, 64, 1)x(384, 1, 1), Context 1, Stream 13, Device 0, CC 9.0
    dram__bytes_read.sum         Gbyte        73.42
    Cluster Size                                                   2
"""


def test_launches_and_their_metrics_are_read_in_order():
    launches = ncu_summary.parse(REPORT)
    assert [launch["kernel"] for launch in launches] == ["ep_wgmma_gemm_gather",
                                                         "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT"]
    first, second = launches
    assert first["grid"] == [16, 8, 128] and first["block"] == [384, 1, 1] and first["device"] == 0
    assert first["metrics"]["Elapsed Cycles"] == {"unit": "cycle", "value": 5727739}
    assert first["metrics"]["Duration"] == {"unit": "ms", "value": 3.83}
    assert first["metrics"]["L2 Cache Throughput"]["value"] == 97.79
    assert first["metrics"]["Cluster Size"] == {"unit": "", "value": 0}
    assert "Metric Name" not in first["metrics"] and len(first["metrics"]) == 4  # headers and advice are not metrics
    assert second["metrics"] == {"dram__bytes_read.sum": {"unit": "Gbyte", "value": 73.42},
                                 "Cluster Size": {"unit": "", "value": 2}}


def test_main_writes_one_run_per_report_and_refuses_a_report_without_launches(tmp_path, capsys):
    report = tmp_path / "a.txt"
    report.write_text(REPORT)
    out = tmp_path / "out.json"
    assert ncu_summary.main([str(report), "--commit", "abc", "--command", "ncu x", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["commit"] for r in data["runs"]] == ["abc"] and len(data["runs"][0]["launches"]) == 2
    empty = tmp_path / "empty.txt"
    empty.write_text("==PROF== nothing profiled\n")
    assert ncu_summary.main([str(empty), "--commit", "abc", "--command", "c", "--json", str(out)]) == 1
    assert "no profiled launch" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one --commit per report
        ncu_summary.main([str(report), str(report), "--commit", "abc", "--command", "c", "--json", str(out)])
