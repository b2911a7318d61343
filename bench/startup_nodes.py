"""Startup of a job of K nodes on this machine: K `tray launch --nnodes K` processes over 127.0.0.1, each
with L ranks on the host backend. Measures launch -> every rank of the job ready, the time of one job-wide
`exchange` (median of ITERS, every rank), the root's own cost (messages, the time spent handling them and its CPU
time, printed by node 0's head), the CPU time of each node (its head, watchdog and ranks, whole run), and the
teardown (the last rank's end -> the last head's exit). One node is a plain tray (no root).

    python bench/startup_nodes.py --nnodes 1,2,4,8,16 [-n 2] [--repeats 3] [--iters 50] \
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
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tray.envinfo import environment
from tray.launch.jobdir import scratch_dir

ITERS = 50
RANK_PROGRAM = """
import json, sys, time
import tray
with tray.init() as rank:
    t_ready = time.time()
    rank.exchange("warm", 0)
    times = []
    for i in range(int(sys.argv[2])):
        t = time.perf_counter()
        rank.exchange("step", i)
        times.append(time.perf_counter() - t)
with open(f"{sys.argv[1]}/rank-{rank.rank}.json", "w") as f:
    json.dump({"t_ready": t_ready, "exchange_s": sorted(times)[len(times) // 2], "t_end": time.time()}, f)
"""
_ROOT_LINE = re.compile(r"root: (\d+) nodes, (\d+) messages in, (\d+) out, ([\d.]+) ms handling them"
                        r"(?: \(([\d.]+) ms of CPU\))?")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(proc: subprocess.Popen, out: dict) -> None:
    """Reap `proc`, noting when it exited and the CPU time of it and its reaped descendants (its ranks, watchdog)."""
    _, status, usage = os.wait4(proc.pid, 0)
    out.update(t_exit=time.time(), cpu_s=usage.ru_utime + usage.ru_stime, returncode=os.waitstatus_to_exitcode(status))
    proc.returncode = out["returncode"]


def job_once(nnodes: int, nprocs: int, iters: int, workdir: Path) -> dict:
    prog = workdir / "rank.py"
    prog.write_text(RANK_PROGRAM)
    out = workdir / f"out-{time.monotonic_ns()}"
    out.mkdir()
    env = dict(os.environ, TRAY_JOB_TOKEN=secrets.token_hex(32))
    port = _port()
    base = [sys.executable, "-m", "tray", "launch", "-n", str(nprocs), "--backend", "host",
            "--manifest", str(REPO / "manifests" / "peer_fill.json"), "--var", "words=16", "--var", "count=16"]
    t0 = time.time()
    procs, waits, ended = [], [], []
    for node in range(nnodes):
        job = ["--nnodes", str(nnodes), "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}"]
        cmd = [*base, *(job if nnodes > 1 else []), "--timeout-s", "300", "--", sys.executable, str(prog), str(out),
               str(iters)]
        with open(out / f"node-{node}.err", "w") as err:  # a file, not a pipe: 100+ heads would fill pipes unread
            # cwd: `-m tray` imports the tray of this checkout, not one in the caller's directory
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO))
        ended.append({})
        waits.append(threading.Thread(target=_wait, args=(procs[-1], ended[-1]), daemon=True))
        waits[-1].start()
    for w in waits:
        w.join(timeout=600)
    errs = [(out / f"node-{node}.err").read_text(errors="replace") for node in range(nnodes)]
    if any(e.get("returncode", -1) for e in ended):
        raise SystemExit(f"a node failed: {[e.get('returncode') for e in ended]}\n" + "\n".join(errs))
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nnodes * nprocs)]
    found = _ROOT_LINE.search(errs[0])
    root = None
    if found:
        root = {"messages_in": int(found[2]), "messages_out": int(found[3]), "busy_s": float(found[4]) / 1e3,
                "busy_cpu_s": float(found[5]) / 1e3 if found[5] else None}
    cpu = [e["cpu_s"] for e in ended]
    return {"ready_s": max(r["t_ready"] for r in ranks) - t0,
            "exchange_s": statistics.median(r["exchange_s"] for r in ranks),
            "teardown_s": max(e["t_exit"] for e in ended) - max(r["t_end"] for r in ranks),
            "node0_cpu_s": cpu[0], "other_node_cpu_s": statistics.median(cpu[1:]) if nnodes > 1 else None,
            "root": root}


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nnodes", default="1,2,4,8,16", help="comma-separated node counts")
    ap.add_argument("-n", "--nproc-per-node", dest="n", type=int, default=2, help="ranks per node")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=ITERS, help="job-wide exchanges timed per run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    counts = [int(k) for k in args.nnodes.split(",")]
    rows = []
    with scratch_dir() as tmp:  # locked under the jobs root: the next tray removes it if this process is killed
        job_once(1, 2, args.iters, Path(tmp))  # warm the page cache (2 ranks: the manifest's pairs need an even count)
        for k in counts:
            runs = [job_once(k, args.n, args.iters, Path(tmp)) for _ in range(args.repeats)]
            roots = [r["root"] for r in runs if r["root"]]
            row = {"nnodes": k, "ranks": k * args.n,
                   "ready_s": statistics.median(r["ready_s"] for r in runs),
                   "exchange_us": statistics.median(r["exchange_s"] for r in runs) * 1e6,
                   "teardown_s": statistics.median(r["teardown_s"] for r in runs),
                   "node0_cpu_s": statistics.median(r["node0_cpu_s"] for r in runs),
                   "other_node_cpu_s": _median([r["other_node_cpu_s"] for r in runs]),
                   "root_messages_in": _median([r["messages_in"] for r in roots]),
                   "root_busy_ms": _median([r["busy_s"] * 1e3 for r in roots]),
                   "root_cpu_ms": _median([r["busy_cpu_s"] * 1e3 if r["busy_cpu_s"] is not None else None
                                           for r in roots]),
                   # the medians of each run's ratio: the root's time and CPU time per message it received
                   "root_busy_us_per_message": _median([r["busy_s"] / r["messages_in"] * 1e6 for r in roots]),
                   "root_cpu_us_per_message": _median([r["busy_cpu_s"] / r["messages_in"] * 1e6
                                                       if r["busy_cpu_s"] is not None else None for r in roots]),
                   "runs": runs}
            rows.append(row)
            root = "no root (one tray)"
            if roots:
                root = (f"root: {row['root_messages_in']:.0f} messages in, {row['root_busy_ms']:.1f} ms busy, "
                        f"{row['root_busy_us_per_message']:.0f} µs a message")
                if row["root_cpu_us_per_message"] is not None:
                    root += f" ({row['root_cpu_us_per_message']:.0f} µs of CPU)"
            print(f"{k:3d} nodes x {args.n} ranks: launch -> ready {row['ready_s']:.2f} s, job-wide exchange "
                  f"{row['exchange_us']:.0f} µs, teardown {row['teardown_s']:.2f} s, {root}", flush=True)
    report = {"bench": "startup_nodes", "nprocs_per_node": args.n, "repeats": args.repeats,
              "exchange_iters": args.iters, "backend": "host", "rows": rows, "cpus": os.cpu_count(),
              "environment": environment()}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
