"""The peer barrier against its baselines, measured in the same run.

tray: the peer-barrier gate (eager, eager_sync, captured µs per barrier, per rank and median).
Baselines, when torch is importable and GPUs are visible: PyTorch SymmetricMemory barrier (eager, in a
graph, and one barrier + stream synchronize: the baseline of eager_sync) and `dist.barrier()` (a host-side
barrier, reported only). Prints ratios; writes one JSON with the environment.

    python bench/peer_barrier.py -n 4 [--backend cuda] [--iters 1000] [--json bench/results/peer_barrier.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from torch_baselines import run_baseline  # beside this script

from tray.backend import detect_backend
from tray.bench import Row, format_table, ratio, write_report
from tray.programs.peer_barrier.gate import GateArgs, run_gate


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    backend = args.backend or detect_backend()
    with tempfile.TemporaryDirectory() as tmp:
        gate_json = Path(tmp) / "gate.json"
        code = run_gate(GateArgs(nprocs=args.n, backend=backend, iters=args.iters, json_path=str(gate_json),
                                 quiet=True))
        report = json.loads(gate_json.read_text()) if gate_json.exists() else {"passed": False}
    report["bench"] = "peer_barrier"
    if backend == "cuda":
        base = run_baseline("barrier", args.n, iters=args.iters)
        if base is not None:
            report["torch"] = base
            report["ratios"] = {
                "eager_vs_symm_eager": ratio(report["eager_us"], base["symm_eager_us"]),
                "captured_vs_symm_captured": ratio(report["captured_us"], base["symm_captured_us"]),
                "eager_sync_vs_symm_sync": ratio(report["eager_sync_us"], base["symm_sync_us"]),
            }
            print("baselines, same run:")
            print(format_table([Row("symm_mem eager", 0, 0, "none", base["symm_eager_us"], -1),
                                Row("symm_mem captured", 0, 0, "none", base["symm_captured_us"], -1),
                                Row("symm_mem + sync", 0, 0, "none", base["symm_sync_us"], -1),
                                Row("dist.barrier", 0, 0, "none", base["dist_barrier_us"], -1)]))
            for k, v in report["ratios"].items():
                print(f"  ratio {k}: {v:.2f}")
    write_report(report, args.json)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
