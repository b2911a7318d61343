"""Where an NCCL communicator's join and close go, on one GPU (cuda): the ~0.45 s join and ~0.46 s destroy that a
rank's start-up and close show (`rank.timings`: `collectives` / `nccl_early.init`, `close.collectives`).

Each case runs in a fresh interpreter (this Python), the cases interleaved over `--repeats` rounds; in each, one
1-rank communicator after another (`--comms`, the first apart: it pays NCCL's own library set-up) is joined
(ncclCommInitRank, as tray joins: tray.collectives.nccl.join_all), runs one allreduce (synchronised), and is closed
one way:
  destroy            ncclCommDestroy (what NcclGroup.close does)
  finalize+destroy   ncclCommFinalize, then ncclCommDestroy (each timed)
  abort              ncclCommAbort
each with NCCL_RUNTIME_CONNECT=0 (what the launcher gives ranks, so a capture makes no connection) and =1 (NCCL's
default). One more run with NCCL_DEBUG=INFO keeps NCCL's own account of the join (its "Init timings" line) and of
the close, its lines stamped to the microsecond: when, after the destroy began, each of NCCL's proxy threads
exited and the destroy completed (`close_timeline`). Medians; writes JSON (with the environment).

    python bench/nccl_lifecycle.py [--repeats 3] [--comms 3] [--json bench/results/h200/nccl_lifecycle.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from tray.bench import median, stage, write_report

BENCH = "nccl-lifecycle"
CLOSES = ("destroy", "finalize+destroy", "abort")
TIMEOUT_S = 120.0

CHILD = """
import json, sys, time
import numpy as np
from tray.backend.base import GroupInfo
from tray.backend.cuda import driver as drv
from tray.collectives.nccl import _nccl, get_unique_id, join_all
close_how, comms = sys.argv[1], int(sys.argv[2])
drv.init()
dev = drv.device_get(0)
ctx = drv.primary_ctx_retain(dev)
drv.ctx_set_current(ctx, 0)
stream = drv.stream_create()
send, recv = drv.mem_alloc(4), drv.mem_alloc(4)
one = np.ones(1, np.float32)
drv.memcpy_htod_async(send, one.ctypes.data, 4, stream)
mod = _nccl()
out = []
for _ in range(comms):
    t0 = time.perf_counter()
    group = join_all([(GroupInfo("world", (0,), 0), get_unique_id())], int(stream), 0)["world"]
    t1 = time.perf_counter()
    group.allreduce(send, recv, 1, "f32")
    drv.stream_synchronize(stream)
    t2 = time.perf_counter()
    got = np.zeros(1, np.float32)
    drv.memcpy_dtoh_async(got.ctypes.data, recv, 4, stream)
    drv.stream_synchronize(stream)
    assert got[0] == 1.0, got
    row = {"init_s": t1 - t0, "first_allreduce_s": t2 - t1}
    t3 = time.perf_counter()
    print(f"STAMP close-begin {time.time():.6f}", flush=True)
    if close_how == "destroy":
        mod.comm_destroy(group.comm)
    elif close_how == "abort":
        mod.comm_abort(group.comm)
    else:
        mod.comm_finalize(group.comm)
        row["finalize_s"] = time.perf_counter() - t3
        mod.comm_destroy(group.comm)
    row["close_s"] = time.perf_counter() - t3
    print(f"STAMP close-end {time.time():.6f}", flush=True)
    group._state = "closed"  # closed here, by the call under test
    out.append(row)
print("RESULT " + json.dumps(out), flush=True)
"""


def run_case(close: str, runtime_connect: str, comms: int, debug: bool = False) -> tuple[list[dict], list[str]]:
    """One fresh interpreter: `comms` communicators joined, used and closed `close`'s way; its rows, and NCCL's
    own INFO lines about the join's and close's timings when `debug`."""
    env = dict(os.environ, NCCL_RUNTIME_CONNECT=runtime_connect)
    if debug:  # INFO lines stamped to the microsecond on the same clock as the child's STAMP lines
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,PROXY", NCCL_DEBUG_TIMESTAMP_LEVELS="INFO",
                   NCCL_DEBUG_TIMESTAMP_FORMAT="[%s.%6f] ")
    done = subprocess.run([sys.executable, "-c", CHILD, close, str(comms)], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise SystemExit(f"{BENCH}: the {close} case failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    rows = next(json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT "))
    if debug:
        stamps = [line for line in done.stdout.splitlines() if line.startswith("STAMP ")]
        rows = [{**rows[0], "close_timeline": close_timeline(
            [line for line in done.stdout.splitlines() if "NCCL INFO" in line], stamps)}]
    notes = [line for line in done.stdout.splitlines() if "timings" in line.lower() or "destroy" in line.lower()
             or "[Proxy Service" in line or "Connection closed" in line]
    return rows, notes


CLOSE_EVENTS = ("[Proxy Service UDS] exit", "Connection closed by localRank", "Destroy COMPLETE", "close-end")


def close_timeline(notes: list[str], stamps: list[str]) -> list[dict[str, Any]]:
    """Milliseconds after the (first) close began at which NCCL's stamped INFO lines of the close came: its proxy
    threads' exits and the destroy's end (from `notes`, "[epoch.micro] ... NCCL INFO ...") and the call's return
    (`stamps`, the child's "STAMP close-begin|close-end epoch")."""
    begin = next((float(s.split()[2]) for s in stamps if s.startswith("STAMP close-begin")), None)
    if begin is None:
        return []
    out = []
    for line in notes + stamps:
        event = next((e for e in CLOSE_EVENTS if e in line), None)
        if event is None:
            continue
        try:
            t = float(line.split()[2]) if line.startswith("STAMP") else float(line[1:line.index("]")])
        except ValueError:
            continue
        if t >= begin:
            out.append({"ms": round((t - begin) * 1e3, 3), "event": event, "line": line.strip()[:240]})
    return sorted(out, key=lambda e: e["ms"])


def summarize(rows_by_round: list[list[dict]]) -> dict[str, Any]:
    """Medians over rounds: the first communicator of a process apart from the later ones."""
    first = [rows[0] for rows in rows_by_round]
    later = [r for rows in rows_by_round for r in rows[1:]]
    out: dict[str, Any] = {}
    for name, rows in (("first", first), ("later", later)):
        if rows:
            out[name] = {k: median([r[k] for r in rows]) for k in rows[0]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every case (default 3)")
    ap.add_argument("--comms", type=int, default=3, help="communicators one after another per process (default 3)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.comms < 1:
        ap.error("--repeats and --comms must be 1 or more")
    cases = [(close, rc) for rc in ("0", "1") for close in CLOSES]
    stage(BENCH, 1, 2, f"{len(cases)} cases x {args.repeats} rounds, {args.comms} communicators each")
    rounds: dict[tuple[str, str], list[list[dict]]] = {c: [] for c in cases}
    for i in range(args.repeats):
        for close, rc in cases:
            rounds[(close, rc)].append(run_case(close, rc, args.comms)[0])
        print(f"{BENCH}: round {i + 1}/{args.repeats} done", flush=True)
    stage(BENCH, 2, 2, "NCCL_DEBUG=INFO: NCCL's own account of a join and a destroy, stamped")
    debug_rows, notes = run_case("destroy", "0", 1, debug=True)
    timeline = debug_rows[0]["close_timeline"]
    report: dict[str, Any] = {"bench": BENCH, "repeats": args.repeats, "comms": args.comms, "ranks": 1,
                              "cases": [{"close": close, "runtime_connect": int(rc), **summarize(rounds[(close, rc)]),
                                         "rounds": rounds[(close, rc)]} for close, rc in cases],
                              "nccl_debug": notes, "close_timeline": timeline}
    print(f"{BENCH}: one-rank communicators, medians (first of a process / later ones):")
    for case in report["cases"]:
        first, later = case["first"], case.get("later", {})
        print(f"  runtime_connect={case['runtime_connect']} {case['close']:<17} join {first['init_s'] * 1e3:6.1f} / "
              f"{later.get('init_s', float('nan')) * 1e3:6.1f} ms, close {first['close_s'] * 1e3:6.1f} / "
              f"{later.get('close_s', float('nan')) * 1e3:6.1f} ms"
              + (f" (finalize {later.get('finalize_s', first['finalize_s']) * 1e3:.1f} ms)" if "finalize_s" in first
                 else ""))
    for line in notes:
        print(f"  NCCL: {line.strip()}")
    print("  a destroy, ms after it began (NCCL_DEBUG=INFO, stamped):")
    for e in timeline:
        print(f"    {e['ms']:9.3f}  {e['event']}")
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
