"""Where a rank's "import" phase goes: the interpreter's start, the modules a rank loads before its handshake,
the backend's modules, and whether the driver warm-up thread (started by `tray.init` before those imports on
cuda) slows them down.

Each case runs in a fresh interpreter (this Python), `--repeats` times, the cases interleaved, after one untimed
run (the page cache warm); medians:
  bare          `python -c pass`: the interpreter's own start, spawn to exit
  rank          spawn -> `tray.rank` imported (what a rank has loaded when its handshake starts: the startup
                bench's "import" phase), then the backend's modules (imported in its "device" phase)
  rank+warmup   the same with `DriverWarmup(0)` started first, as `tray.init` does (cuda only); then its wait
  warmup        `DriverWarmup(0)` alone, waited for: cuInit and the primary context on a thread (cuda only)
Then `-X importtime` of the `rank` case: the top-level modules by cumulative time, and the slowest modules
below them. Writes JSON (with the environment).

    python bench/import_cost.py [--backend host|cuda] [--repeats 5] [--json bench/results/import_cost.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from tray.backend import detect_backend
from tray.bench import median, stage, write_report

BENCH = "import-cost"
STAGES = 3
TIMEOUT_S = 120.0

CHILD = """
import json, sys, time
t0 = time.perf_counter()
backend, warm, only_warmup = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
out = {}
warmup = None
if warm:
    from tray.backend.cuda import DriverWarmup
    warmup = DriverWarmup(0)
if not only_warmup:
    import tray.rank
    out["t_rank"] = time.time()
    out["rank_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    if backend == "cuda":
        import tray.backend.cuda.backend
    else:
        import tray.backend.host
    out["backend_s"] = time.perf_counter() - t1
if warmup is not None:
    t1 = time.perf_counter()
    warmup.release(60.0)
    out["warmup_wait_s"] = time.perf_counter() - t1
    out["warmup_s"] = warmup.seconds
out["t_end"] = time.time()
print(json.dumps(out))
"""


def run_child(backend: str, warm: bool, only_warmup: bool = False, importtime: bool = False) -> dict[str, Any]:
    """One fresh interpreter; its JSON line with `spawn_to_rank_s` / `spawn_to_end_s` (wall, from before the
    spawn) added, and its -X importtime lines as `importtime` when asked."""
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-c", CHILD, backend,
           "1" if warm else "0", "1" if only_warmup else "0"]
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise SystemExit(f"{BENCH}: the child failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if "t_rank" in out:
        out["spawn_to_rank_s"] = out.pop("t_rank") - t0
    out["spawn_to_end_s"] = out.pop("t_end") - t0
    if importtime:
        out["importtime"] = done.stderr
    return out


def bare_start() -> float:
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=TIMEOUT_S)
    return time.time() - t0


def parse_importtime(text: str) -> list[tuple[str, int, int, int]]:
    """(module, self us, cumulative us, depth) per line of `-X importtime` output, in its order (children
    before their parent); depth 0 is a module imported by the program itself."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        parts = line[len("import time:"):].split("|")
        if len(parts) != 3:
            continue
        raw = parts[2].rstrip()
        stripped = raw.lstrip(" ")
        depth = (len(raw) - len(stripped) - 1) // 2
        rows.append((stripped, int(parts[0]), int(parts[1]), max(depth, 0)))
    return rows


def summarize_importtime(text: str, top: int = 12) -> dict[str, Any]:
    """The top-level modules by cumulative ms, and the `top` modules with the most self time."""
    rows = parse_importtime(text)
    total_us = sum(r[1] for r in rows)
    roots = sorted((r for r in rows if r[3] == 0), key=lambda r: -r[2])
    by_self = sorted(rows, key=lambda r: -r[1])[:top]
    return {"total_ms": total_us / 1e3,
            "top_level_ms": {r[0]: r[2] / 1e3 for r in roots[:top]},
            "slowest_self_ms": {r[0]: r[1] / 1e3 for r in by_self}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    backend = args.backend or detect_backend()
    t_start = time.monotonic()
    cases: dict[str, list[dict[str, Any]]] = {"bare": [], "rank": [], "rank+warmup": [], "warmup": []}
    stage(BENCH, 1, STAGES, f"{args.repeats} rounds of fresh interpreters, {backend} backend "
                            f"(bare, rank{', rank+warmup, warmup' if backend == 'cuda' else ''}), interleaved")
    run_child(backend, False)  # untimed: the page cache warm, as for the startup bench's timed runs
    for _ in range(args.repeats):
        cases["bare"].append({"spawn_to_end_s": bare_start()})
        cases["rank"].append(run_child(backend, False))
        if backend == "cuda":
            cases["rank+warmup"].append(run_child(backend, True))
            cases["warmup"].append(run_child(backend, True, only_warmup=True))
    t0 = stage(BENCH, 2, STAGES, "-X importtime of the rank case")
    profile = summarize_importtime(run_child(backend, False, importtime=True)["importtime"])
    stage(BENCH, 3, STAGES, f"report (previous stage {time.monotonic() - t0:.1f} s)")
    summary: dict[str, dict[str, float]] = {}
    for name, runs in cases.items():
        if runs:
            keys = sorted({k for r in runs for k in r})
            summary[name] = {k: median([r[k] for r in runs if k in r]) for k in keys}
    report = {"bench": "import_cost", "backend": backend, "repeats": args.repeats, "median": summary,
              "importtime": profile, "runs": cases}
    print(f"import cost, {backend} backend, median of {args.repeats}:")
    print(f"  interpreter start (python -c pass)       {summary['bare']['spawn_to_end_s'] * 1e3:7.1f} ms")
    r = summary["rank"]
    print(f"  spawn -> tray.rank imported              {r['spawn_to_rank_s'] * 1e3:7.1f} ms "
          f"(the imports themselves {r['rank_s'] * 1e3:.1f} ms); the backend's modules {r['backend_s'] * 1e3:.1f} ms")
    if "rank+warmup" in summary:
        w, a = summary["rank+warmup"], summary["warmup"]
        print(f"  the same with the driver warm-up running  {w['spawn_to_rank_s'] * 1e3:7.1f} ms "
              f"(imports {w['rank_s'] * 1e3:.1f} ms, backend {w['backend_s'] * 1e3:.1f} ms, then waited "
              f"{w['warmup_wait_s'] * 1e3:.1f} ms for the warm-up of {w['warmup_s'] * 1e3:.1f} ms)")
        print(f"  the warm-up alone                        {a['warmup_s'] * 1e3:7.1f} ms "
              f"(spawn -> done {a['spawn_to_end_s'] * 1e3:.1f} ms)")
    print(f"  -X importtime: {profile['total_ms']:.1f} ms in all; top level: " +
          ", ".join(f"{k} {v:.1f}" for k, v in list(profile["top_level_ms"].items())[:6]))
    print("  slowest modules (self ms): " + ", ".join(f"{k} {v:.1f}" for k, v in profile["slowest_self_ms"].items()))
    write_report(report, args.json)
    print(f"{BENCH}: done in {time.monotonic() - t_start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
