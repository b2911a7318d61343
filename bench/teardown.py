"""Teardown: where a tray's end goes, from a rank's `rank.close()` to `tray launch` returning.

Each run is `tray launch -n N` of the startup bench's manifest with a rank program that joins NCCL (cuda: one
allreduce; host: the relayed one), calls `rank.close()`, and ends one of these ways, the ways in alternation:
  exit      the program returns: the interpreter's finalization, then the libraries' own exit handlers (the CUDA
            driver's and runtime's context teardown among them), then the kernel closes the process
  os_exit   os._exit(0) from the program's last exit handler: no finalization, no library exit handler; the
            kernel still closes the process's files (the GPU's device files among them) before the head sees it end
  reset     (cuda) cuDevicePrimaryCtxReset on the rank's GPU in its last exit handler, timed, then as `exit`
Per run, the slowest rank: `close_s` (rank.close()), `tail_s` (its last exit handler -> `tray launch` returned:
the rest of the rank's end, the head noticing it, the head's own teardown and exit) and, for `reset`, `reset_s`;
the tail split where the head's process is about to end (`tray launch` runs under a wrapper that stamps it):
`rank_to_head_s` (the rank's end, the head noticing it, its teardown) and `head_exit_s` (the head's process
ending: since tray.cli ends it at once after a `tray launch`, only the kernel's part). `exit`'s tail minus
`os_exit`'s is what the rank's finalization costs. Medians over `--repeats`; JSON with the environment.

    python bench/teardown.py [-n 1] [--backend host|cuda] [--repeats 5] [--json bench/results/teardown.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tray.backend import detect_backend
from tray.bench import median, stage, write_report
from tray.launch.jobdir import scratch_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import bench_manifest  # bench/startup.py: the same manifest

BENCH = "teardown"
STAGES = 2
TIMEOUT_S = 120.0
WAYS = {"host": ("exit", "os_exit"), "cuda": ("exit", "os_exit", "reset")}
HEAD_STAMP = "tray-teardown: the head's process ends at"
# `tray launch` as the command runs it, stamping the time when the head's process is about to end: from an exit
# handler registered first (so run last), or just before tray.cli ends the process at once (_exit_now)
HEAD = f"""
import atexit, os, sys, time
stamp = lambda: os.write(2, b"\\n{HEAD_STAMP} %r\\n" % time.time())
atexit.register(stamp)
sys.argv[0] = "tray"
import tray.cli as cli
if hasattr(cli, "_exit_now"):
    exit_now = cli._exit_now
    cli._exit_now = lambda code: (stamp(), exit_now(code))
cli.program()
"""

RANK_PROGRAM = """
import atexit, json, os, sys, time
import numpy as np
import tray
out_dir, way = sys.argv[1], sys.argv[2]
rank = tray.init()
send, recv = rank.buffer("send"), rank.buffer("recv")
rank.write("send", np.full(send.shape, rank.rank + 1, np.float32))
rank.collectives("world").allreduce(send.ptr, recv.ptr, 1, "f32")
rank.backend.synchronize()
assert float(rank.read("recv")[0]) == rank.world_size * (rank.world_size + 1) / 2
cuda = os.environ["TRAY_BACKEND"] == "cuda"
device = int(os.environ["TRAY_DEVICE"])
t0 = time.time()
rank.close()
t_closed = time.time()
path = f"{out_dir}/rank-{rank.rank}.json"


def last():  # registered first: atexit runs it after every other exit handler of the program
    record = {"close_s": t_closed - t0, "t_closed": t_closed}
    if way == "reset" and cuda:
        from cuda.bindings import driver as cu
        t = time.perf_counter()
        err, dev = cu.cuDeviceGet(device)
        (err2,) = cu.cuDevicePrimaryCtxReset(dev)
        record["reset_s"] = time.perf_counter() - t
        record["reset_errors"] = [int(err), int(err2)]  # CUresult codes: 0 is CUDA_SUCCESS
    record["t_last"] = time.time()
    with open(path, "w") as f:
        json.dump(record, f)
    if way == "os_exit":
        os._exit(0)


atexit.register(last)
"""


def once(n: int, backend: str, work: Path, manifest: Path, way: str) -> dict[str, Any]:
    """One `tray launch` ending `way`: the slowest rank's close, reset and tail (its last exit handler ->
    the command returned)."""
    prog = work / "teardown_rank.py"
    prog.write_text(RANK_PROGRAM)
    out = work / f"out-{time.monotonic_ns()}"
    out.mkdir()
    cmd = [sys.executable, "-P", "-c", HEAD, "launch", "-n", str(n), "--backend", backend, "--manifest",
           str(manifest), "-q", "--join-collectives", "lazy", "--", sys.executable, str(prog), str(out), way]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=dict(os.environ, TRAY_CACHE_DIR=str(work / "kernel-cache")))
    t_returned = time.time()
    if done.returncode != 0:
        raise SystemExit(f"tray launch ({way}) failed (exit {done.returncode}):\n{done.stdout[-2000:]}"
                         f"{done.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(n)]
    bad = [r["reset_errors"] for r in ranks if any(r.get("reset_errors", ()))]
    if bad:
        raise SystemExit(f"cuDevicePrimaryCtxReset failed: {bad}")
    t_last = min(r["t_last"] for r in ranks)
    stamps = [float(line.rsplit(" ", 1)[1]) for line in done.stderr.splitlines() if line.startswith(HEAD_STAMP)]
    if len(stamps) != 1:
        raise SystemExit(f"expected one line '{HEAD_STAMP} T' from the head, saw {len(stamps)}:\n{done.stderr[-2000:]}")
    run = {"close_s": max(r["close_s"] for r in ranks), "tail_s": t_returned - t_last,
           "rank_to_head_s": stamps[0] - t_last, "head_exit_s": t_returned - stamps[0],
           "closed_to_last_s": max(r["t_last"] - r["t_closed"] for r in ranks)}
    if way == "reset":
        run["reset_s"] = max(r["reset_s"] for r in ranks)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=1)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.n < 1:
        ap.error("-n and --repeats must be at least 1")
    backend = args.backend or detect_backend()
    ways = WAYS[backend]
    t_start = time.monotonic()
    with scratch_dir() as tmp:  # locked under the jobs root: the next tray removes it if this process is killed
        work = Path(tmp)
        manifest = bench_manifest(work / "teardown.json", args.n)
        stage(BENCH, 1, STAGES, f"{args.n} ranks, {backend} backend: one untimed run (kernel cache, page cache)")
        once(args.n, backend, work, manifest, "exit")
        stage(BENCH, 2, STAGES, f"{args.repeats} runs of each way ({', '.join(ways)}), in alternation")
        runs: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
        for _ in range(args.repeats):
            for w in ways:
                runs[w].append(once(args.n, backend, work, manifest, w))
    medians = {w: {k: median([r[k] for r in rs]) for k in rs[0]} for w, rs in runs.items()}
    report: dict[str, Any] = {
        "bench": BENCH, "nprocs": args.n, "backend": backend, "repeats": args.repeats, "median": medians,
        "finalization_s": medians["exit"]["tail_s"] - medians["os_exit"]["tail_s"], "runs": runs,
    }
    for w, m in medians.items():
        extra = f", reset {1e3 * m['reset_s']:.1f} ms" if "reset_s" in m else ""
        print(f"{BENCH}: {w:8s} close {1e3 * m['close_s']:7.1f} ms{extra}, last exit handler -> `tray launch` "
              f"returned {1e3 * m['tail_s']:7.1f} ms (until the head ends its process {1e3 * m['rank_to_head_s']:.1f}"
              f", its exit {1e3 * m['head_exit_s']:.1f})")
    print(f"{BENCH}: the rank's finalization (exit - os_exit tails): {1e3 * report['finalization_s']:.1f} ms")
    write_report(report, args.json)
    print(f"{BENCH}: done in {time.monotonic() - t_start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
