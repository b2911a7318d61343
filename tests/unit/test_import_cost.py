"""bench/import_cost.py: its -X importtime parsing, and a host run's report."""

from __future__ import annotations

import json

from bench.import_cost import main, parse_importtime, summarize_importtime

SAMPLE = """import time: self [us] | cumulative | imported package
import time:       100 |        100 |   _io
import time:        50 |        150 | io
import time:      2000 |       2000 |       numpy._core.multiarray
import time:       300 |       2300 |     numpy._core
import time:       700 |       3000 |   numpy
import time:      1000 |       4000 | tray.rank
not an importtime line
"""


def test_importtime_lines_give_module_self_cumulative_and_depth():
    rows = parse_importtime(SAMPLE)
    assert rows[0] == ("_io", 100, 100, 1) and rows[1] == ("io", 50, 150, 0)
    assert rows[2] == ("numpy._core.multiarray", 2000, 2000, 3) and rows[-1] == ("tray.rank", 1000, 4000, 0)
    summary = summarize_importtime(SAMPLE, top=2)
    assert summary["total_ms"] == 4.15  # the self times summed
    assert list(summary["top_level_ms"]) == ["tray.rank", "io"] and summary["top_level_ms"]["tray.rank"] == 4.0
    assert summary["slowest_self_ms"] == {"numpy._core.multiarray": 2.0, "tray.rank": 1.0}


def test_a_host_run_reports_every_case_it_ran(tmp_path, capsys):
    path = tmp_path / "import_cost.json"
    assert main(["--backend", "host", "--repeats", "1", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert set(report["median"]) == {"bare", "rank"}  # the warm-up cases are cuda's
    rank = report["median"]["rank"]
    assert 0 < rank["rank_s"] < rank["spawn_to_rank_s"] <= rank["spawn_to_end_s"]
    assert "tray.rank" in report["importtime"]["top_level_ms"]
    assert "spawn -> tray.rank imported" in capsys.readouterr().out
