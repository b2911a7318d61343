"""A long-running tray: what its head and a rank hold after many tray-wide steps.

`tray launch -n N` (host backend) of a program whose ranks make `--steps` exchanges, each mode its own launch:
  unique    a new topic per step (`rank.exchange(f"step-{i}", i)`): per-topic state kept for the tray's life
            grows with every step
  reused    one topic for every step (`rank.exchange("step", i)`): the baseline
At every `--every` steps rank 0 records the time since the first step, its own and the head's RSS, open file
descriptors and threads (psutil; the head is the rank's parent), and how many topics the rank counts rounds of.
The report has per mode: the first and last checkpoints, the growth per 1000 steps between them (RSS in KiB; the
first checkpoint is after `--every` steps, so start-up allocations are left out), microseconds per exchange in each
interval (the first, the last, the median). JSON with the environment.

    python bench/long_run.py [-n 2] [--steps 100000] [--every 10000] [--modes unique,reused] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tray.bench import median, stage, write_report
from tray.launch.jobdir import scratch_dir

BENCH = "long_run"
TIMEOUT_S = 1800.0

RANK_PROGRAM = """
import json, os, sys, time
import psutil
import tray

out, mode, steps, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
me, head = psutil.Process(), psutil.Process(os.getppid())


def sample(i, t0):
    return {"step": i, "s": time.perf_counter() - t0, "rank_rss": me.memory_info().rss,
            "head_rss": head.memory_info().rss, "rank_fds": me.num_fds(), "head_fds": head.num_fds(),
            "rank_threads": me.num_threads(), "head_threads": head.num_threads(),
            "rank_topics": len(getattr(rank, "_rounds", ()))}


with tray.init() as rank:
    points = []
    rank.exchange("warm", 0)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        topic = f"step-{i}" if mode == "unique" else "step"
        values = rank.exchange(topic, i)
        assert values == [i] * rank.world_size, values
        if i % every == 0 and rank.rank == 0:
            points.append(sample(i, t0))
    if rank.rank == 0:
        with open(os.path.join(out, f"{mode}.json"), "w") as f:
            json.dump(points, f)
"""


def once(n: int, mode: str, steps: int, every: int, work: Path) -> list[dict[str, Any]]:
    prog = work / "long_run_rank.py"
    prog.write_text(RANK_PROGRAM)
    cmd = [sys.executable, "-m", "tray", "launch", "-n", str(n), "--backend", "host", "-q", "--", sys.executable,
           str(prog), str(work), mode, str(steps), str(every)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise SystemExit(f"tray launch ({mode}) failed (exit {done.returncode}):\n{done.stdout[-2000:]}"
                         f"{done.stderr[-3000:]}")
    points: list[dict[str, Any]] = json.loads((work / f"{mode}.json").read_text())
    return points


def summary(points: list[dict[str, Any]], every: int) -> dict[str, Any]:
    first, last = points[0], points[-1]
    k = (last["step"] - first["step"]) / 1000 or 1
    per = [(b["s"] - a["s"]) / every * 1e6 for a, b in zip([{"s": 0.0}, *points], points)]  # µs, each interval
    return {
        "first": first, "last": last,
        "rank_rss_kib_per_1000": (last["rank_rss"] - first["rank_rss"]) / 1024 / k,
        "head_rss_kib_per_1000": (last["head_rss"] - first["head_rss"]) / 1024 / k,
        "rank_fds_growth": last["rank_fds"] - first["rank_fds"],
        "head_fds_growth": last["head_fds"] - first["head_fds"],
        "rank_threads_growth": last["rank_threads"] - first["rank_threads"],
        "head_threads_growth": last["head_threads"] - first["head_threads"],
        "us_per_exchange_first": per[0], "us_per_exchange_last": per[-1], "us_per_exchange_median": median(per),
        "us_per_exchange": per,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--every", type=int, default=10_000)
    ap.add_argument("--modes", default="unique,reused")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if args.n < 1 or args.every < 1 or args.steps < 2 * args.every or set(modes) - {"unique", "reused"}:
        ap.error("-n >= 1, --every >= 1, --steps >= 2 x --every, --modes of unique,reused")
    t_start = time.monotonic()
    report: dict[str, Any] = {"bench": BENCH, "nprocs": args.n, "backend": "host", "steps": args.steps,
                              "every": args.every, "modes": {}}
    with scratch_dir() as tmp:  # locked under the jobs root: the next tray removes it if this process is killed
        for i, mode in enumerate(modes, 1):
            stage(BENCH, i, len(modes), f"{args.n} ranks, {args.steps} exchanges, {mode} topics")
            points = once(args.n, mode, args.steps, args.every, Path(tmp))
            s = summary(points, args.every)
            report["modes"][mode] = {**s, "points": points}
            print(f"{BENCH}: {mode:7s} per 1000 exchanges: rank RSS {s['rank_rss_kib_per_1000']:+.1f} KiB, head "
                  f"RSS {s['head_rss_kib_per_1000']:+.1f} KiB; topics counted at rank 0: {s['last']['rank_topics']}; "
                  f"fds rank {s['rank_fds_growth']:+d} head {s['head_fds_growth']:+d}, threads rank "
                  f"{s['rank_threads_growth']:+d} head {s['head_threads_growth']:+d}; "
                  f"µs per exchange: {s['us_per_exchange_first']:.0f} in the first interval, "
                  f"{s['us_per_exchange_last']:.0f} in the last, median {s['us_per_exchange_median']:.0f}", flush=True)
    write_report(report, args.json)
    print(f"{BENCH}: done in {time.monotonic() - t_start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
