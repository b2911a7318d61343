"""The peer barrier against its baselines, measured in the same run.

tray: the peer-barrier gate (eager, eager_sync, captured µs per barrier, per rank and median).
Baselines, when torch is importable and GPUs are visible: PyTorch SymmetricMemory barrier (eager and in a
graph) and `dist.barrier()`. Prints ratios; writes one JSON with the environment.

    python bench/peer_barrier.py -n 4 [--backend cuda] [--iters 1000] [--json bench/results/peer_barrier.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.torch_baselines import run_baseline
from tray.backend import detect_backend
from tray.gate.peer_barrier import GateArgs, run_gate


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
                "eager_vs_symm_eager": report["eager_us"] / base["symm_eager_us"],
                "captured_vs_symm_captured": report["captured_us"] / base["symm_captured_us"],
                "eager_sync_vs_dist_barrier": report["eager_sync_us"] / base["dist_barrier_us"],
            }
            print(f"baseline SymmetricMemory barrier: eager {base['symm_eager_us']:.2f} µs, "
                  f"captured {base['symm_captured_us']:.2f} µs; dist.barrier {base['dist_barrier_us']:.1f} µs")
            for k, v in report["ratios"].items():
                print(f"  ratio {k}: {v:.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
