"""Startup of a job of K nodes on this machine: K `tray launch --nnodes K` processes over 127.0.0.1, each
with L ranks on the host backend. Measures launch -> every rank of the job ready, the time of one job-wide
`exchange` (median of ITERS, every rank), and the root's own cost (messages and the time spent handling
them, printed by node 0's head). One node is a plain tray (no root).

    python bench/startup_nodes.py --nnodes 1,2,4,8,16 [-n 2] [--repeats 3] \
        [--json bench/results/host/startup_nodes.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tray.envinfo import environment
from tray.launch.jobdir import scratch_dir

ITERS = 50
RANK_PROGRAM = f"""
import json, sys, time
import tray
with tray.init() as rank:
    t_ready = time.time()
    rank.exchange("warm", 0)
    times = []
    for i in range({ITERS}):
        t = time.perf_counter()
        rank.exchange("step", i)
        times.append(time.perf_counter() - t)
    with open(f"{{sys.argv[1]}}/rank-{{rank.rank}}.json", "w") as f:
        json.dump({{"t_ready": t_ready, "exchange_s": sorted(times)[len(times) // 2]}}, f)
"""
_ROOT_LINE = re.compile(r"root: (\d+) nodes, (\d+) messages in, (\d+) out, ([\d.]+) ms handling")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_once(nnodes: int, nprocs: int, workdir: Path) -> dict:
    prog = workdir / "rank.py"
    prog.write_text(RANK_PROGRAM)
    out = workdir / f"out-{time.monotonic_ns()}"
    out.mkdir()
    env = dict(os.environ, TRAY_JOB_TOKEN=secrets.token_hex(32))
    port = _port()
    base = [sys.executable, "-m", "tray", "launch", "-n", str(nprocs), "--backend", "host",
            "--manifest", str(REPO / "manifests" / "peer_fill.json"), "--var", "words=16", "--var", "count=16"]
    t0 = time.time()
    procs = []
    for node in range(nnodes):
        job = ["--nnodes", str(nnodes), "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}"]
        cmd = [*base, *(job if nnodes > 1 else []), "--timeout-s", "120", "--", sys.executable, str(prog), str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=300)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a node failed: {[p.returncode for p in procs]}\n" + "\n".join(errs))
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nnodes * nprocs)]
    found = _ROOT_LINE.search(errs[0])
    root = None
    if found:
        root = {"messages_in": int(found[2]), "messages_out": int(found[3]), "busy_s": float(found[4]) / 1e3}
    return {"ready_s": max(r["t_ready"] for r in ranks) - t0,
            "exchange_s": statistics.median(r["exchange_s"] for r in ranks), "root": root}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nnodes", default="1,2,4,8,16", help="comma-separated node counts")
    ap.add_argument("-n", type=int, default=2, help="ranks per node")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    counts = [int(k) for k in args.nnodes.split(",")]
    rows = []
    with scratch_dir() as tmp:  # locked under the jobs root: the next tray removes it if this process is killed
        job_once(1, args.n, Path(tmp))  # warm the page cache
        for k in counts:
            runs = [job_once(k, args.n, Path(tmp)) for _ in range(args.repeats)]
            roots = [r["root"] for r in runs if r["root"]]
            row = {"nnodes": k, "ranks": k * args.n,
                   "ready_s": statistics.median(r["ready_s"] for r in runs),
                   "exchange_us": statistics.median(r["exchange_s"] for r in runs) * 1e6,
                   "root_messages_in": statistics.median(r["messages_in"] for r in roots) if roots else None,
                   "root_busy_ms": statistics.median(r["busy_s"] for r in roots) * 1e3 if roots else None,
                   "runs": runs}
            rows.append(row)
            root = (f"root: {row['root_messages_in']:.0f} messages in, {row['root_busy_ms']:.1f} ms busy"
                    if roots else "no root (one tray)")
            print(f"{k:3d} nodes x {args.n} ranks: launch -> ready {row['ready_s']:.2f} s, job-wide exchange "
                  f"{row['exchange_us']:.0f} µs, {root}", flush=True)
    report = {"bench": "startup_nodes", "nprocs_per_node": args.n, "repeats": args.repeats, "exchange_iters": ITERS,
              "backend": "host", "rows": rows, "cpus": os.cpu_count(), "environment": environment()}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
