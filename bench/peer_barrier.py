"""The peer barrier against its baselines, measured in the same run.

tray: the peer-barrier gate (eager, eager_sync, captured µs per barrier, per rank and median).
Baselines, when torch is importable and GPUs are visible: PyTorch SymmetricMemory barrier (eager, in a
graph, and one barrier + stream synchronize: the baseline of eager_sync) and `dist.barrier()` (a host-side
barrier, reported only). Prints a progress line per stage, the ratios; writes one JSON with the
environment and, with --plot, a PNG of µs per barrier by mode (tray beside the baselines).

    python bench/peer_barrier.py -n 4 [--backend cuda] [--iters 1000] [--json bench/results/peer_barrier.json]
                                 [--plot bench/results/peer_barrier.png]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from torch_baselines import run_baseline  # beside this script

from tray.backend import detect_backend
from tray.bench import Row, format_table, plot_bars, ratio, require_plot, stage, write_report
from tray.errors import UsageError
from tray.launch.jobdir import scratch_dir
from tray.programs.peer_barrier.gate import GateArgs, run_gate

BENCH = "peer-barrier"
STAGES = 3
# The gate's modes, and the key of the same-run SymmetricMemory figure each is compared with (None: none).
MODES = (("eager", "symm_eager_us"), ("eager_sync", "symm_sync_us"), ("captured", "symm_captured_us"),
         ("eager_graph", None))


def plot(report: dict[str, Any], path: str) -> None:
    """µs per barrier by mode: tray's median, SymmetricMemory's where it has that mode, and
    `dist.barrier()` (a host barrier) as a category of its own; NaN where a figure was not taken."""
    nan = float("nan")
    base = report.get("torch") or {}

    def value(figure: float | None) -> float:
        return nan if figure is None else figure

    categories = [mode for mode, _ in MODES]
    series = {"tray": [value(report.get(f"{mode}_us")) for mode, _ in MODES]}
    if base:
        categories.append("host barrier")
        series["tray"].append(nan)
        series["SymmetricMemory"] = [value(base.get(key)) if key else nan for _, key in MODES] + [nan]
        series["dist.barrier"] = [nan] * len(MODES) + [value(base.get("dist_barrier_us"))]
    # NOTE: a log scale only where the figures span more than 10x (dist.barrier is ~10x a device barrier)
    taken = [v for values in series.values() for v in values if not math.isnan(v) and v > 0]
    log_y = bool(taken) and max(taken) > 10 * min(taken)
    plot_bars(path, categories, series, ylabel="µs per barrier (median of ranks)", log_y=log_y,
              title=f"peer barrier: {report['nprocs']} ranks, {report['backend']} backend, "
                    f"{report['iters']} per repeat")


def _since(t: float) -> str:
    """'previous stage S s' for a stage line: the elapsed seconds of the stage begun at time.monotonic() t."""
    return f"previous stage {time.monotonic() - t:.1f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="µs per barrier by mode, tray beside the baselines (the `plot` extra)")
    args = ap.parse_args(argv)
    try:
        require_plot(args.plot)
    except UsageError as exc:
        ap.error(str(exc))
    backend = args.backend or detect_backend()
    t0 = stage(BENCH, 1, STAGES, f"tray gate: {args.n} ranks, {backend} backend, {args.iters} barriers per repeat")
    with scratch_dir() as tmp:  # locked under the jobs root: the next tray removes it if this process is killed
        gate_json = Path(tmp) / "gate.json"
        code = run_gate(GateArgs(nprocs=args.n, backend=backend, iters=args.iters, json_path=str(gate_json),
                                 quiet=True))
        report = json.loads(gate_json.read_text()) if gate_json.exists() else {"passed": False}
    report["bench"] = "peer_barrier"
    t1 = stage(BENCH, 2, STAGES, f"SymmetricMemory baseline ({_since(t0)})")
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
        else:
            print(f"{BENCH}: no baseline (torch is not importable or sees no GPU)", flush=True)
    else:
        print(f"{BENCH}: no baseline on the {backend} backend (it needs torch and GPUs)", flush=True)
    stage(BENCH, 3, STAGES, f"report{' and plot' if args.plot else ''} ({_since(t1)})")
    write_report(report, args.json)
    if args.plot and report.get("nprocs") is None:
        print(f"{BENCH}: no plot: the gate wrote no report", flush=True)
    elif args.plot:
        plot(report, args.plot)
        print(f"{BENCH}: plot in {args.plot}", flush=True)
    print(f"{BENCH}: done in {time.monotonic() - t0:.1f} s", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
