"""Kernel variants of the peer barrier, timed by the gate in one run (keeps the faster correct one).

Each variant is a directory holding a `peer_barrier.cu` with the production kernel's signature; the
gate runs with TRAY_KERNEL_DIR pointing at it. "production" is manifests/kernels.

    python bench/barrier_variants.py -n 4 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tray.envinfo import environment  # noqa: E402
from tray.gate.peer_barrier import GateArgs, run_gate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # (kernel dir, programmatic launches); the variants predate `griddepcontrol.wait`, so no PDL
    variants = {"production": (REPO / "manifests" / "kernels", "1"),
                "production-nopdl": (REPO / "manifests" / "kernels", "0")}
    variants.update({d.name: (d, "0") for d in sorted((REPO / "bench" / "barrier_variants").iterdir())
                     if d.is_dir()})
    results = {}
    for name, (kdir, pdl) in variants.items():
        os.environ["TRAY_KERNEL_DIR"] = str(kdir)
        os.environ["TRAY_BARRIER_PDL"] = pdl
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "gate.json"
            code = run_gate(GateArgs(nprocs=args.n, backend="cuda", iters=args.iters, json_path=str(out),
                                     quiet=True))
            report = json.loads(out.read_text()) if out.exists() else {}
        results[name] = {k: report.get(k) for k in ("eager_us", "eager_sync_us", "captured_us", "passed")}
        results[name]["exit_code"] = code
    os.environ.pop("TRAY_KERNEL_DIR", None)
    os.environ.pop("TRAY_BARRIER_PDL", None)
    print(f"{'variant':<12}{'eager':>9}{'sync':>9}{'captured':>10}")
    for name, r in results.items():
        if r["eager_us"] is not None:
            print(f"{name:<12}{r['eager_us']:>9.2f}{r['eager_sync_us']:>9.2f}{r['captured_us']:>10.2f}")
        else:
            print(f"{name:<12} failed (exit {r['exit_code']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"variants": results, "environment": environment()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
