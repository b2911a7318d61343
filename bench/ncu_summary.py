"""Nsight Compute's text report (`ncu --section ...` output, one block per profiled launch) as JSON: per launch the
kernel, its grid and block, and every metric line of its sections (name, unit, value), so the figures a note
quotes from a profile are in a file beside the timings.

    python bench/ncu_summary.py gemm_ncu.txt --commit HASH --command "ncu ... python bench/expert_gemm.py ..." \
        --json bench/results/h200/expert_gemm_ncu.json

Several reports (each with its own --commit and --command, in order) go into one file as separate runs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

# "  ep_wgmma_gemm_gather (16, 8, 128)x(384, 1, 1), Context 1, Stream 13, Device 0, CC 9.0"
_LAUNCH = re.compile(r"^  (\S+) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context \d+, Stream \d+, Device (\d+)")
# "    L2 Cache Throughput               %        97.79"; units may be absent ("Cluster Size  0" has none)
_METRIC = re.compile(r"^    (\S.*?\S)\s{2,}(\S+)\s{2,}([-\d.,]+)\s*$")
_METRIC_NO_UNIT = re.compile(r"^    (\S.*?\S)\s{2,}([-\d.,]+)\s*$")


def _number(text: str) -> float | int:
    value = float(text.replace(",", ""))
    return int(value) if value.is_integer() and "." not in text else value


def parse(text: str) -> list[dict[str, Any]]:
    """The launches of one ncu text report, in order: {kernel, grid, block, device, metrics: {name: {unit, value}}}."""
    launches: list[dict[str, Any]] = []
    for line in text.splitlines():
        m = _LAUNCH.match(line)
        if m:
            g = [int(x) for x in m.groups()[1:8]]
            launches.append({"kernel": m.group(1), "grid": g[0:3], "block": g[3:6], "device": g[6], "metrics": {}})
            continue
        if not launches:
            continue
        m = _METRIC.match(line)
        if m:
            launches[-1]["metrics"][m.group(1)] = {"unit": m.group(2), "value": _number(m.group(3))}
            continue
        m = _METRIC_NO_UNIT.match(line)
        if m:
            launches[-1]["metrics"][m.group(1)] = {"unit": "", "value": _number(m.group(2))}
    return launches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/ncu_summary.py", description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", type=Path, help="ncu text reports")
    ap.add_argument("--commit", action="append", required=True, help="the commit each report was made at")
    ap.add_argument("--command", action="append", required=True, help="the command that made each report")
    ap.add_argument("--gpu", default="", help="the GPU the reports were made on")
    ap.add_argument("--json", required=True, type=Path)
    a = ap.parse_args(argv)
    if not len(a.reports) == len(a.commit) == len(a.command):
        ap.error(f"give one --commit and one --command per report: {len(a.reports)} reports, {len(a.commit)} "
                 f"--commit, {len(a.command)} --command")
    runs = []
    for report, commit, command in zip(a.reports, a.commit, a.command, strict=True):
        launches = parse(report.read_text(errors="replace"))
        if not launches:
            print(f"{report}: no profiled launch found (is it ncu's text output?)", file=sys.stderr)
            return 1
        runs.append({"report": report.name, "commit": commit, "command": command, "launches": launches})
    a.json.write_text(json.dumps({"bench": "ncu", "gpu": a.gpu, "runs": runs}, indent=1) + "\n")
    print(f"{a.json}: {sum(len(r['launches']) for r in runs)} launches from {len(runs)} reports")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
