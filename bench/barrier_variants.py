"""Kernel variants of the peer barrier, timed by the gate in one run (keeps the faster correct one).

Each variant is a directory holding a `peer_barrier.cu` with the production kernel's signature; the
gate runs with TRAY_KERNEL_DIR pointing at it. "production" is manifests/kernels.

    python bench/barrier_variants.py -n 4 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tray.envinfo import environment
from tray.programs.peer_barrier.gate import GateArgs, run_gate


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # (kernel dir, environment); v0/v2 predate `griddepcontrol.wait`, so they run without PDL
    kernels = REPO / "manifests" / "kernels"
    variants: dict[str, tuple[Path, dict[str, str]]] = {
        "production": (kernels, {}),
        "prod-nopdl": (kernels, {"TRAY_BARRIER_PDL": "0"}),
        "prod-bindings": (kernels, {"TRAY_BARRIER_PDL": "0", "TRAY_LAUNCH": "bindings"}),
    }
    for d in sorted((REPO / "bench" / "barrier_variants").iterdir()):
        if d.is_dir():
            pdl = "1" if (d / "PDL").exists() else "0"
            variants[d.name] = (d, {"TRAY_BARRIER_PDL": pdl})
    results = {}
    for name, (kdir, env) in variants.items():
        for key in ("TRAY_BARRIER_PDL", "TRAY_LAUNCH"):
            os.environ.pop(key, None)
        os.environ.update(env)
        os.environ["TRAY_KERNEL_DIR"] = str(kdir)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "gate.json"
            code = run_gate(GateArgs(nprocs=args.n, backend="cuda", iters=args.iters, json_path=str(out),
                                     quiet=True))
            report = json.loads(out.read_text()) if out.exists() else {}
        results[name] = {k: report.get(k) for k in ("eager_us", "eager_sync_us", "captured_us", "passed")}
        results[name]["eager_host_us"] = statistics.median(r["eager_host_us"] for r in report["per_rank"]) \
            if report.get("per_rank") else None
        results[name]["exit_code"] = code
    for key in ("TRAY_KERNEL_DIR", "TRAY_BARRIER_PDL", "TRAY_LAUNCH"):
        os.environ.pop(key, None)
    print(f"{'variant':<14}{'eager':>9}{'host':>9}{'sync':>9}{'captured':>10}")
    for name, r in results.items():
        if r["eager_us"] is not None:
            print(f"{name:<14}{r['eager_us']:>9.2f}{r['eager_host_us']:>9.2f}{r['eager_sync_us']:>9.2f}"
                  f"{r['captured_us']:>10.2f}")
        else:
            print(f"{name:<12} failed (exit {r['exit_code']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"variants": results, "environment": environment()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
