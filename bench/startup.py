"""Startup: `tray launch` -> every rank ready (offers, peers mapped, barriers up) -> first allreduce.

The clock starts before `tray launch` is executed, as a user waits: the head's own interpreter start and imports
(`head`: until the first rank is spawned) count. Then per phase the slowest rank, median over repeats. The same
tray started by `run_tray` from this already-running Python (the head's start excluded) is timed too
(`in_process`): that is the figure compared with torch's, whose workers are spawned from a running Python too.
The collectives join on first use (`--join-collectives lazy`; the NCCL join, ~0.5 s, is not part of "ready"):
`first_allreduce_s` includes it, `collectives_s` says how long it took. On cuda the same tray with NCCL joined
while the ranks start (`--join-collectives early`) is timed in alternation with it (`tray_early`: its
`nccl_early_s` is the join's time on its thread, `collectives_s` what the allreduce still waited for), and both
again with the program busy `--work-ms` between ready and its first allreduce (`tray_busy`: a program that
loads weights, say, before it reduces; it sleeps here).
The first run starts with an empty kernel cache (`cold`:
NVRTC compiles the barrier); the timed repeats reuse it (`warm`); the page cache is warm for both
(the same Python files).
The head initialises the driver on a thread right after the spawn, and each rank starts its own on a
thread while its modules import (`driver_warmup` is that thread's time, overlapped). The `tray launch` runs come
first, while this process has not initialised CUDA (it counts the GPUs from /proc where it can); its in-process runs
do (their head is this process), so from then on a live process holds the driver, and the environment's
`persistence_mode` says whether the driver keeps the GPUs initialised without one.

With torch importable and GPUs visible, two baselines: `torchrun` executed -> init_process_group(nccl) -> first
allreduce in every worker (its launcher's start counted, against `tray launch`'s), and torch spawned from a running
Python (against `run_tray`), with its `import torch` reported apart (`import_s`) and the time after it
(`after_import_s`) beside tray's time after its imports. Writes JSON (with the
environment) and prints the ratios; a progress line per stage. With --plot, a PNG of the slowest rank's
phases stacked (warm and cold kernel cache), the rest up to the first allreduce on top, and torch's spawn ->
first allreduce beside them.

Wake from park, apart from a cold start (--wake-gib G, 0 to skip): a tray whose manifest also holds a paged
state (G GiB of device pages per rank and as many in its pinned host tier) fills a lease of all of it, parks
it, writes garbage over the device pool, and times the tray-wide wake (slowest rank), checking every byte after
it. Beside it, in the same run: how long writing the same bytes from pageable host memory into the lease takes
(`load_s`: the least a cold start pays to bring that state back from host RAM, disk excluded), and launch ->
ready of that tray (its pools allocated and pinned at start).

    python bench/startup.py -n 4 [--backend host|cuda] [--repeats 5] [--wake-gib G] [--json bench/results/startup.json]
                            [--plot bench/results/startup.png]
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
from tray.bench import median, plot_bars, ratio, require_plot, stage, write_report
from tray.errors import UsageError
from tray.launch import TraySpec, run_tray
from tray.launch.jobdir import scratch_dir
from tray.manifest.builtin import builtin_path

RANK_PROGRAM = """
import json, os, sys, time
import numpy as np
import tray
t_init = time.time()
rank = tray.init()
t_ready = time.time()
timings = dict(rank.timings)
time.sleep(float(sys.argv[2]) / 1e3)  # --work-ms: the program busy elsewhere before its first collective
send, recv = rank.buffer("send"), rank.buffer("recv")
rank.write("send", np.full(send.shape, rank.rank + 1, np.float32))
rank.collectives("world").allreduce(send.ptr, recv.ptr, 1, "f32")
rank.backend.synchronize()
got = float(rank.read("recv")[0])
want = rank.world_size * (rank.world_size + 1) / 2
assert got == want, (got, want)
t_first = time.time()
collectives_s = rank.timings.get("collectives")
nccl_early_s = rank.timings.get("nccl_early")
early_steps = {k.split(".", 1)[1]: v for k, v in rank.timings.items() if k.startswith("nccl_early.")}
me, path = rank.rank, f"{sys.argv[1]}/rank-{rank.rank}.json"
rank.close()
t_closed = time.time()
close = {k.split(".", 1)[1]: v for k, v in rank.timings.items() if k.startswith("close.")}
with open(path, "w") as f:
    json.dump({"t_ready": t_ready, "t_first_allreduce": t_first, "t_closed": t_closed, "timings": timings,
               "close_s": close, "t_spawn": float(os.environ["TRAY_T_SPAWN"]), "collectives_s": collectives_s,
               "nccl_early_s": nccl_early_s, "early_steps": early_steps, "t_init": t_init}, f)
"""

WAKE_PROGRAM = """
import json, sys, time
import tray
from tray.programs.park.bench import CHUNK_NBYTES, Pattern, check, fill, scribble
with tray.init() as rank:
    t_ready = time.time()
    backend = rank.backend
    session = rank.lease(int(sys.argv[2]))
    pattern = Pattern(rank.rank + 1, session.page_nbytes, session.nbytes)
    per = max(1, CHUNK_NBYTES // session.page_nbytes)  # pages per write; the lease is contiguous (a fresh pool)
    chunk = pattern.pages(0, per)
    fill(backend, session, pattern)  # first touch of every page (the host backend's memfd) is not the load's cost
    rank.exchange("startup.load", 0)
    t0 = time.perf_counter()
    for first in range(0, session.npages, per):
        n = min(per, session.npages - first)
        backend.write(session.ptr(first), chunk[: n * session.page_nbytes])
    backend.synchronize()
    load_s = time.perf_counter() - t0
    fill(backend, session, pattern)
    session.touch()
    parked = rank.park(session)
    scribble(backend, session.parking.pool(session.state))  # a wake that copied nothing fails the check
    rank.exchange("startup.wake", 0)
    t0 = time.perf_counter()
    session = rank.wake(parked)
    backend.synchronize()
    wake_s = time.perf_counter() - t0
    checked = check(backend, session, pattern, rank.rank)
    nbytes = session.nbytes
    session.release()
    with open(f"{sys.argv[1]}/rank-{rank.rank}.json", "w") as f:
        json.dump({"t_ready": t_ready, "load_s": load_s, "wake_s": wake_s, "nbytes": nbytes,
                   "checked_bytes": checked}, f)
"""
PAGE_NBYTES = 2 << 20


def bench_manifest(path: Path, n: int, pages: int = 0) -> Path:
    """peer_fill's manifest (its kernel sources made absolute) written to `path`: at an odd `n` its `pairs`
    groups of one rank each (a pair needs an even world; the tray keeps as many groups); with `pages`, one paged
    state of `pages` pages of PAGE_NBYTES on the device and as many in the host tier."""
    base = builtin_path("peer_fill")
    doc = json.loads(Path(base).read_text())
    for k in doc.get("kernels", []):
        k["source"] = str((Path(base).parent / k["source"]).resolve())
    if n % 2:
        for g in doc["groups"]:
            if g["name"] == "pairs":
                g["size"] = 1
    if pages:
        doc["name"] = "startup_wake"
        doc["states"] = [{"name": "kv", "page_nbytes": PAGE_NBYTES, "pages": pages, "host_pages": pages}]
    path.write_text(json.dumps(doc, indent=1))
    return path


def wake_once(n: int, backend: str, workdir: Path, cache_dir: Path, pages: int) -> dict:
    """One tray with a state of `pages` pages per rank: launch -> ready, then load / park / wake (slowest rank)."""
    prog = workdir / "startup_wake.py"
    prog.write_text(WAKE_PROGRAM)
    manifest = bench_manifest(workdir / "startup_wake.json", n, pages)
    out = workdir / f"wake-{time.monotonic_ns()}"
    out.mkdir()
    t0 = time.time()
    run_launch(launch_command(n, backend, str(manifest), [sys.executable, str(prog), str(out), str(pages)]),
               cache_dir, "tray launch (wake from park)")
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(n)]
    return {
        "ready_s": max(r["t_ready"] for r in ranks) - t0,
        "load_s": max(r["load_s"] for r in ranks),
        "wake_s": max(r["wake_s"] for r in ranks),
        "nbytes_per_rank": ranks[0]["nbytes"],
        "checked_bytes": sum(r["checked_bytes"] for r in ranks),
    }


def launch_command(n: int, backend: str, manifest: str, cmd: list[str], join: str = "auto") -> list[str]:
    """`tray launch` as a user types it, with this Python (-P: an installed tray, not a checkout's tray/ in the
    working directory)."""
    return [sys.executable, "-P", "-m", "tray", "launch", "-n", str(n), "--backend", backend, "--manifest",
            manifest, "-q", "--join-collectives", join, "--", *cmd]


def run_launch(cmd: list[str], cache_dir: Path, what: str) -> None:
    """Run `cmd` (a `tray launch`) with the kernel cache `cache_dir`, at most TRAY_TIMEOUT_S; SystemExit with
    its output's tail when it fails."""
    done = subprocess.run(cmd, env=dict(os.environ, TRAY_CACHE_DIR=str(cache_dir)), capture_output=True, text=True,
                          timeout=TRAY_TIMEOUT_S)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")


def tray_once(n: int, backend: str, workdir: Path, cache_dir: Path, from_command: bool = True,
              join: str = "lazy", work_ms: float = 0.0) -> dict:
    """One tray of RANK_PROGRAM. `from_command`: the clock starts before `tray launch` is executed (the head's own
    start and imports included, as a user waits for them); else `run_tray` in this already-running Python. `join`:
    when the ranks join NCCL (`--join-collectives`: lazy, at the allreduce; early, while they start). `work_ms`:
    how long each rank sleeps between ready and the allreduce (a program busy elsewhere, e.g. loading weights).
    Phases: `head` (clock start -> first rank spawned), `spawn` (first -> last rank spawned), then per phase the
    slowest rank's own time."""
    prog = workdir / "startup_rank.py"
    prog.write_text(RANK_PROGRAM)
    out = workdir / f"out-{time.monotonic_ns()}"
    out.mkdir()
    manifest = str(bench_manifest(workdir / "startup.json", n))
    rank_cmd = [sys.executable, str(prog), str(out), repr(work_ms)]
    t0 = time.time()
    if from_command:
        run_launch(launch_command(n, backend, manifest, rank_cmd, join), cache_dir, f"tray launch ({join} join)")
    else:
        result = run_tray(TraySpec(nprocs=n, cmd=tuple(rank_cmd), backend=backend, manifest=manifest, quiet=True,
                                   extra_env=(("TRAY_CACHE_DIR", str(cache_dir)),), join_collectives=join))
        if result.exit_code != 0:
            raise SystemExit(f"tray failed: {result.root_cause}")
    t_exit = time.time()
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(n)]
    spawned = [r["t_spawn"] for r in ranks]
    phases = {"head": min(spawned) - t0, "spawn": max(spawned) - min(spawned)}
    for p in PHASES[2:]:
        phases[p] = max(r["timings"].get(p, 0.0) for r in ranks)
    return {
        "ready_s": max(r["t_ready"] for r in ranks) - t0,
        "first_allreduce_s": max(r["t_first_allreduce"] for r in ranks) - t0,
        "exit_s": t_exit - t0,
        "close_s": max(r["t_closed"] - r["t_first_allreduce"] for r in ranks),
        "close_steps_s": {k: max(r["close_s"].get(k, 0.0) for r in ranks) for k in ranks[0]["close_s"]},
        "collectives_s": max(r["collectives_s"] or 0.0 for r in ranks),
        "nccl_early_s": max(r.get("nccl_early_s") or 0.0 for r in ranks),
        "nccl_early_steps_s": {k: max(r["early_steps"].get(k, 0.0) for r in ranks) for k in ranks[0]["early_steps"]},
        "init_called_s": max(r["t_init"] - r["t_spawn"] for r in ranks),
        "driver_warmup_s": max(r["timings"].get("driver_warmup", 0.0) for r in ranks),
        "phases": phases,
    }


def summarize(runs: list[dict]) -> dict[str, Any]:
    """Medians over `runs` of every figure and phase."""
    phases = sorted({p for r in runs for p in r["phases"]})
    out: dict[str, Any] = {k: median([r[k] for r in runs])
                           for k in ("ready_s", "first_allreduce_s", "exit_s", "close_s", "collectives_s",
                                     "nccl_early_s", "driver_warmup_s", "init_called_s")}
    out["nccl_early_steps_s"] = {k: median([r["nccl_early_steps_s"].get(k, 0.0) for r in runs])
                                 for k in runs[0]["nccl_early_steps_s"]}
    out["close_steps_s"] = {k: median([r["close_steps_s"].get(k, 0.0) for r in runs]) for k in runs[0]["close_steps_s"]}
    out["phases_s"] = {p: median([r["phases"].get(p, 0.0) for r in runs]) for p in phases}
    return out


BENCH = "startup"
STAGES = 6
TRAY_TIMEOUT_S = 300.0
WAKE_DEFAULT_GIB = {"host": 0.25, "cuda": 2.0}
# The phases in the order a rank passes them, stacked bottom up in the plot: the head's start, its spawns, then
# the ranks' own (slowest rank per phase).
PHASES = ("head", "spawn", "import", "manifest", "device", "allocate", "offer", "table", "import_peers", "join",
          "ready")


def plot(report: dict[str, Any], path: str) -> None:
    """Seconds from launch, stacked: per phase the slowest rank's time (warm: median of the repeats; cold:
    the first run), then the rest up to the first allreduce (the collectives' join on first use); torch's
    spawn + import and its init_process_group + first allreduce beside them when it ran."""
    nan = float("nan")
    warm, cold, base = report["tray"], report["cold"], report.get("torch")
    categories = ["tray launch, warm cache", "tray launch, cold cache"]
    runs = [(warm["phases_s"], warm["ready_s"], warm["first_allreduce_s"]),
            (cold["phases"], cold["ready_s"], cold["first_allreduce_s"])]
    series = {p: [phases.get(p, nan) for phases, _, _ in runs] for p in PHASES}
    series["ready -> first allreduce"] = [first - ready for _, ready, first in runs]
    if base:
        categories.append("torch (spawned from a running Python)")
        for values in series.values():
            values.append(nan)
        series["torch: spawn + import torch"] = [nan, nan, base["first_allreduce_s"] - base["after_import_s"]]
        series["torch: init + first allreduce"] = [nan, nan, base["after_import_s"]]
    plot_bars(path, categories, series, stacked=True, ylabel="s from launch (slowest rank per phase)",
              title=f"startup: {report['nprocs']} ranks, {report['backend']} backend")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--wake-gib", type=float, default=None,
                    help="GiB of parked state per rank to wake, apart from the cold start (0: skip; default "
                         f"{WAKE_DEFAULT_GIB['host']} on host, {WAKE_DEFAULT_GIB['cuda']} on cuda)")
    ap.add_argument("--work-ms", type=float, default=500.0,
                    help="cuda: also time lazy and early NCCL joins in a program that is busy this long between ready "
                         "and its first allreduce (0: skip; default 500)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="the phases stacked, warm vs cold, torch beside them (the `plot` extra)")
    args = ap.parse_args(argv)
    try:
        require_plot(args.plot)
    except UsageError as exc:
        ap.error(str(exc))
    backend = args.backend or detect_backend()
    wake_gib = WAKE_DEFAULT_GIB.get(backend, 0.25) if args.wake_gib is None else args.wake_gib
    if wake_gib < 0:
        ap.error(f"--wake-gib must be 0 (skip) or more, got {wake_gib}")
    wake_pages = round(wake_gib * (1 << 30) / PAGE_NBYTES)
    if wake_gib > 0 and wake_pages == 0:
        ap.error(f"--wake-gib {wake_gib} is less than one page ({PAGE_NBYTES >> 20} MiB); use 0 to skip")
    wake_runs: list[dict] = []
    t_start = time.monotonic()
    with scratch_dir() as tmp:  # locked under the jobs root: the next tray removes it if this process is killed
        cache = Path(tmp) / "kernel-cache"  # empty: the first run compiles (cold), the others load (warm)
        t0 = stage(BENCH, 1, STAGES, f"{args.n} ranks, {backend} backend: `tray launch` with an empty kernel cache")
        cold = tray_once(args.n, backend, Path(tmp), cache)
        early = backend == "cuda"  # the early NCCL join exists on cuda only
        stage(BENCH, 2, STAGES, f"{args.repeats} runs of `tray launch` with the kernel cache warm"
                                + (", NCCL joined lazily and early in alternation" if early else "")
                                + f" (previous stage {time.monotonic() - t0:.1f} s)")
        runs, early_runs = [], []
        for i in range(args.repeats):
            t_run = time.monotonic()
            runs.append(tray_once(args.n, backend, Path(tmp), cache))
            if early:
                early_runs.append(tray_once(args.n, backend, Path(tmp), cache, join="early"))
            print(f"{BENCH}: run {i + 1}/{args.repeats} in {time.monotonic() - t_run:.1f} s", flush=True)
        work_runs: dict[str, list[dict]] = {"lazy": [], "early": []}
        if early and args.work_ms > 0:
            print(f"{BENCH}: {args.repeats} more of each, the program busy {args.work_ms:g} ms between ready and "
                  "its first allreduce", flush=True)
            for _ in range(args.repeats):
                for join in ("lazy", "early"):
                    work_runs[join].append(tray_once(args.n, backend, Path(tmp), cache, join=join,
                                                     work_ms=args.work_ms))
        stage(BENCH, 3, STAGES, f"{args.repeats} runs from this running Python (run_tray: the head's start excluded, "
                                "as for the torch baseline's spawn)")
        in_process = [tray_once(args.n, backend, Path(tmp), cache, from_command=False) for _ in range(args.repeats)]
        wake_repeats = min(args.repeats, 3) if wake_pages else 0
        t0 = stage(BENCH, 4, STAGES, f"wake from park: {wake_repeats} runs with {wake_pages} pages "
                                     f"({wake_pages * PAGE_NBYTES / (1 << 30):.3g} GiB) of state per rank"
                   if wake_pages else "wake from park: skipped (--wake-gib 0)")
        for i in range(wake_repeats):
            wake_runs.append(wake_once(args.n, backend, Path(tmp), cache, wake_pages))
            w = wake_runs[-1]
            print(f"{BENCH}: wake run {i + 1}/{wake_repeats}: wake {w['wake_s'] * 1e3:.1f} ms, "
                  f"load {w['load_s'] * 1e3:.1f} ms, ready {w['ready_s']:.3f} s", flush=True)
    summary = {**summarize(runs), "kernel_cache": "warm", "clock": "from `tray launch` executed",
               "join_collectives": "lazy"}
    inproc = {**summarize(in_process), "kernel_cache": "warm", "clock": "run_tray in a running Python",
              "runs": in_process}
    inproc["after_import_s"] = inproc["first_allreduce_s"] - inproc["phases_s"]["head"] \
        - inproc["phases_s"]["spawn"] - inproc["phases_s"]["import"]
    manifest = "peer_fill" + (" with its pairs groups of one rank each (odd n)" if args.n % 2 else "")
    report = {"bench": "startup", "nprocs": args.n, "backend": backend, "manifest": manifest,
              "repeats": args.repeats, "tray": summary,
              "cold": {**cold, "kernel_cache": "cold"}, "runs": runs, "in_process": inproc}
    if early_runs:
        report["tray_early"] = {**summarize(early_runs), "kernel_cache": "warm", "clock": "from `tray launch` executed",
                                "join_collectives": "early", "runs": early_runs}
        report["ratio_first_allreduce_early_vs_lazy"] = ratio(report["tray_early"]["first_allreduce_s"],
                                                              summary["first_allreduce_s"])
    if work_runs["lazy"]:
        busy = {join: {**summarize(r), "runs": r} for join, r in work_runs.items()}
        report["tray_busy"] = {"work_ms": args.work_ms, **busy, "ratio_first_allreduce_early_vs_lazy": ratio(
            busy["early"]["first_allreduce_s"], busy["lazy"]["first_allreduce_s"])}
    if wake_runs:
        nbytes = wake_runs[0]["nbytes_per_rank"]
        wake = {"gib_per_rank": nbytes / (1 << 30), "wake_s": median([w["wake_s"] for w in wake_runs]),
                "load_s": median([w["load_s"] for w in wake_runs]),
                "ready_with_state_s": median([w["ready_s"] for w in wake_runs]), "runs": wake_runs}
        wake["wake_gb_s"] = nbytes / wake["wake_s"] / 1e9
        wake["cold_restart_s"] = summary["ready_s"] + wake["load_s"]
        wake["ratio_wake_vs_cold_restart"] = ratio(wake["wake_s"], wake["cold_restart_s"])
        report["wake"] = wake
    with_baseline = backend == "cuda" and not args.no_baseline
    why_not = "--no-baseline" if args.no_baseline else f"the {backend} backend; it needs torch and GPUs"
    what = "torchrun and torch spawn -> first allreduce" if with_baseline else f"no torch baseline ({why_not})"
    t0 = stage(BENCH, 5, STAGES, what)
    if with_baseline:
        from torch_baselines import torch_startup, torchrun_startup  # beside this script

        run = torchrun_startup(args.n, args.repeats)
        if run is not None:  # from the command, as `tray launch` above
            report["torchrun"] = run
            report["ratio_first_allreduce_vs_torchrun"] = ratio(summary["first_allreduce_s"], run["first_allreduce_s"])
        base = torch_startup(args.n, args.repeats)
        if base is not None:
            report["torch"] = base
            report["ratio_first_allreduce_vs_torch"] = ratio(inproc["first_allreduce_s"], base["first_allreduce_s"])
            report["ratio_after_import_vs_torch"] = ratio(inproc["after_import_s"], base["after_import_s"])
        else:
            print(f"{BENCH}: no torch baseline (torch is not importable or sees no GPU)", flush=True)
    stage(BENCH, 6, STAGES, f"report{' and plot' if args.plot else ''} (previous stage {time.monotonic() - t0:.1f} s)")
    print(f"startup, {args.n} ranks, {backend} backend, median of {args.repeats} (warm kernel cache):")
    print(f"  `tray launch` -> all ready        {summary['ready_s']:.3f} s  "
          f"(cold kernel cache: {cold['ready_s']:.3f} s)")
    print(f"  `tray launch` -> first allreduce  {summary['first_allreduce_s']:.3f} s  (of which the collectives' join "
          f"{summary['collectives_s']:.3f} s); the command returned after {summary['exit_s']:.3f} s")
    if "tray_early" in report:
        e = report["tray_early"]
        print(f"  NCCL joined early (--join-collectives early): ready {e['ready_s']:.3f} s, first allreduce "
              f"{e['first_allreduce_s']:.3f} s (the join {e['nccl_early_s']:.3f} s on its thread, waited for "
              f"{e['collectives_s']:.3f} s); ratio to the lazy join "
              f"{report['ratio_first_allreduce_early_vs_lazy']:.2f}; the join's parts: "
              + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in e["nccl_early_steps_s"].items())
              + f" (tray.init() called {e['init_called_s'] * 1e3:.0f} ms after the spawn)")
    if "tray_busy" in report:
        b = report["tray_busy"]
        print(f"  busy {b['work_ms']:g} ms between ready and the first allreduce: lazy join ready "
              f"{b['lazy']['ready_s']:.3f} s, first allreduce {b['lazy']['first_allreduce_s']:.3f} s (join "
              f"{b['lazy']['collectives_s']:.3f} s); early join ready {b['early']['ready_s']:.3f} s, first allreduce "
              f"{b['early']['first_allreduce_s']:.3f} s (waited {b['early']['collectives_s']:.3f} s); ratio "
              f"{b['ratio_first_allreduce_early_vs_lazy']:.2f}")
    print(f"  close (slowest rank)             {summary['close_s']:.3f} s: " +
          ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in summary["close_steps_s"].items()))
    print(f"  from a running Python (run_tray): ready {inproc['ready_s']:.3f} s, first allreduce "
          f"{inproc['first_allreduce_s']:.3f} s")
    print(f"  driver warm-up on a thread   {summary['driver_warmup_s']:.3f} s  (overlaps the imports)")
    for p in PHASES:
        if p in summary["phases_s"]:
            print(f"    {p:<14}{summary['phases_s'][p] * 1e3:8.1f} ms (slowest rank)")
    if "wake" in report:
        w = report["wake"]
        print(f"  wake from park, {w['gib_per_rank']:.3g} GiB per rank: {w['wake_s'] * 1e3:.1f} ms "
              f"({w['wake_gb_s']:.1f} GB/s per rank, every byte checked); a cold restart: launch -> ready "
              f"{summary['ready_s']:.3f} s + loading the same bytes from host memory {w['load_s'] * 1e3:.1f} ms "
              f"= {w['cold_restart_s']:.3f} s (ratio {w['ratio_wake_vs_cold_restart']:.3f}); launch -> ready "
              f"with the state's pools allocated {w['ready_with_state_s']:.3f} s")
    if "torchrun" in report:
        t = report["torchrun"]
        print(f"  torchrun executed -> first allreduce {t['first_allreduce_s']:.3f} s (its first worker started "
              f"{t['launcher_s']:.3f} s in, every worker had imported torch at {t['import_s']:.3f} s; returned after "
              f"{t['exit_s']:.3f} s); ratio tray launch/torchrun {report['ratio_first_allreduce_vs_torchrun']:.2f}")
    if "torch" in report:
        t = report["torch"]
        print(f"  torch spawn -> first allreduce {t['first_allreduce_s']:.3f} s "
              f"(spawn + import torch {t['import_s']:.3f} s); ratio tray (from a running Python)/torch "
              f"{report['ratio_first_allreduce_vs_torch']:.2f}")
        print(f"  after the imports: tray {inproc['after_import_s']:.3f} s, torch {t['after_import_s']:.3f} s; "
              f"ratio {report['ratio_after_import_vs_torch']:.2f}")
    write_report(report, args.json)
    if args.plot:
        plot(report, args.plot)
        print(f"{BENCH}: plot in {args.plot}", flush=True)
    print(f"{BENCH}: done in {time.monotonic() - t_start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
