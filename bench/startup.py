"""Startup: `tray launch` -> every rank ready (offers, peers mapped, barriers up) -> first allreduce.

Per phase, the slowest rank (the head's timeline), median over repeats. The collectives join on first
use (the NCCL join, ~0.5 s, is not part of "ready"): `first_allreduce_s` includes it, `collectives_s`
says how long it took. The first run starts with an empty kernel cache (`cold`: NVRTC compiles the
barrier); the timed repeats reuse it (`warm`); the page cache is warm for both (the same Python files).
The head initialises the driver on a thread right after the spawn, and each rank starts its own on a
thread while its modules import (`driver_warmup` is that thread's time, overlapped).

With torch importable and GPUs visible, the baseline runs in the same process: torch spawn ->
init_process_group(nccl) -> first allreduce, with its `import torch` reported apart (`import_s`) and
the time after it (`after_import_s`) beside tray's time after its imports. Writes JSON (with the
environment) and prints the ratios.

    python bench/startup.py -n 4 [--backend host|cuda] [--repeats 5] [--json bench/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tray.backend import detect_backend
from tray.bench import median, ratio, write_report
from tray.launch import TraySpec, run_tray
from tray.manifest.builtin import builtin_path

RANK_PROGRAM = """
import json, sys, time
import numpy as np
import tray
with tray.init() as rank:
    t_ready = time.time()
    timings = dict(rank.timings)
    send, recv = rank.buffer("send"), rank.buffer("recv")
    rank.write("send", np.full(send.shape, rank.rank + 1, np.float32))
    rank.collectives("world").allreduce(send.ptr, recv.ptr, 1, "f32")
    rank.backend.synchronize()
    got = float(rank.read("recv")[0])
    want = rank.world_size * (rank.world_size + 1) / 2
    assert got == want, (got, want)
    t_first = time.time()
    with open(f"{sys.argv[1]}/rank-{rank.rank}.json", "w") as f:
        json.dump({"t_ready": t_ready, "t_first_allreduce": t_first, "timings": timings,
                   "collectives_s": rank.timings.get("collectives")}, f)
"""


def tray_once(n: int, backend: str, workdir: Path, cache_dir: Path) -> dict:
    prog = workdir / "startup_rank.py"
    prog.write_text(RANK_PROGRAM)
    out = workdir / f"out-{time.monotonic_ns()}"
    out.mkdir()
    t0 = time.time()
    result = run_tray(TraySpec(nprocs=n, cmd=(sys.executable, str(prog), str(out)), backend=backend,
                               manifest=str(builtin_path("peer_fill")), quiet=True,
                               extra_env=(("TRAY_CACHE_DIR", str(cache_dir)),)))
    if result.exit_code != 0:
        raise SystemExit(f"tray failed: {result.root_cause}")
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(n)]
    return {
        "ready_s": max(r["t_ready"] for r in ranks) - t0,
        "first_allreduce_s": max(r["t_first_allreduce"] for r in ranks) - t0,
        "collectives_s": max(r["collectives_s"] or 0.0 for r in ranks),
        "driver_warmup_s": max(r["timings"].get("driver_warmup", 0.0) for r in ranks),
        "startup_s": result.startup_s,
        "phases": {k: v[0] for k, v in result.timeline.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-baseline", action="store_true")
    args = ap.parse_args()
    backend = args.backend or detect_backend()
    with tempfile.TemporaryDirectory(prefix="tray-startup-") as tmp:
        cache = Path(tmp) / "kernel-cache"  # empty: the first run compiles (cold), the others load (warm)
        cold = tray_once(args.n, backend, Path(tmp), cache)
        runs = [tray_once(args.n, backend, Path(tmp), cache) for _ in range(args.repeats)]
    phases = sorted({p for r in runs for p in r["phases"]})
    summary = {
        "ready_s": median([r["ready_s"] for r in runs]),
        "first_allreduce_s": median([r["first_allreduce_s"] for r in runs]),
        "collectives_s": median([r["collectives_s"] for r in runs]),
        "driver_warmup_s": median([r["driver_warmup_s"] for r in runs]),
        "phases_s": {p: median([r["phases"].get(p, 0.0) for r in runs]) for p in phases},
        "kernel_cache": "warm",
    }
    summary["after_import_s"] = summary["first_allreduce_s"] - summary["phases_s"].get("import", 0.0)
    report = {"bench": "startup", "nprocs": args.n, "backend": backend, "repeats": args.repeats, "tray": summary,
              "cold": {**cold, "kernel_cache": "cold"}, "runs": runs}
    if backend == "cuda" and not args.no_baseline:
        from torch_baselines import torch_startup  # beside this script

        base = torch_startup(args.n, args.repeats)
        if base is not None:
            report["torch"] = base
            report["ratio_first_allreduce_vs_torch"] = ratio(summary["first_allreduce_s"], base["first_allreduce_s"])
            report["ratio_after_import_vs_torch"] = ratio(summary["after_import_s"], base["after_import_s"])
    print(f"startup, {args.n} ranks, {backend} backend, median of {args.repeats} (warm kernel cache):")
    print(f"  launch -> all ready          {summary['ready_s']:.3f} s  (cold kernel cache: {cold['ready_s']:.3f} s)")
    print(f"  launch -> first allreduce    {summary['first_allreduce_s']:.3f} s  (of which the collectives' join "
          f"{summary['collectives_s']:.3f} s)")
    print(f"  driver warm-up on a thread   {summary['driver_warmup_s']:.3f} s  (overlaps the imports)")
    for p in ("spawn", "import", "device", "manifest", "allocate", "offer", "table", "import_peers", "join",
              "ready"):
        if p in summary["phases_s"]:
            print(f"    {p:<14}{summary['phases_s'][p] * 1e3:8.1f} ms (slowest rank)")
    if "torch" in report:
        t = report["torch"]
        print(f"  torch spawn -> first allreduce {t['first_allreduce_s']:.3f} s "
              f"(spawn + import torch {t['import_s']:.3f} s); "
              f"ratio tray/torch {report['ratio_first_allreduce_vs_torch']:.2f}")
        print(f"  after the imports: tray {summary['after_import_s']:.3f} s, torch {t['after_import_s']:.3f} s; "
              f"ratio {report['ratio_after_import_vs_torch']:.2f}")
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
