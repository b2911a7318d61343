"""`tray bench tp`: a tensor-parallel MLP reduced by a one-shot peer allreduce vs NCCL allreduce.

    tray bench tp -n 4 [--sizes 512,1024,...,4194304] [--hidden 256] [--ffn 1024] [--backend] [--json PATH]
                       [--plot PNG]

Two trays of manifests/tp_mlp.json running tray/programs/tp_mlp/rank_program.py: N ranks (per message size: the peer
allreduce checked to the bit and identical on every rank, NCCL's within tolerance, both captured and
timed; the TP MLP through each where the size is whole rows), then 1 rank (the full MLP on one GPU,
the reference for the TP outputs). Exit 1 if a check fails.
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tray.bench import (
    Row,
    TrayFailed,
    buffers_nbytes,
    format_table,
    plot_lines,
    require_plot,
    run_rank_program,
    stage,
    write_report,
)
from tray.errors import UsageError
from tray.manifest.builtin import builtin_path

MANIFEST = "tp_mlp"  # built-in (package data), see tray.manifest.builtin
DEFAULT_SIZES = tuple(512 << i for i in range(14))  # 512 B .. 4 MiB
DEFAULT_REPEATS = 20
# NOTE: the host backend runs the MLP's GEMMs in numpy (float32 from bf16), ~0.2 s per call at 512 tokens
# on one core: 512 B .. 64 KiB and 5 repeats finish in well under a minute on 2 cores, a few MB per rank.
HOST_SIZES = tuple(512 << i for i in range(8))  # 512 B .. 64 KiB
HOST_REPEATS = 5
# NOTE: the TP partials are rounded to bf16 before the sum; one GPU rounds once: a few bf16 ulps apart.
MLP_TOLERANCE = 2e-2


@dataclass(frozen=True)
class TpBenchArgs:
    nprocs: int
    backend: str
    sizes: tuple[int, ...] = DEFAULT_SIZES
    hidden: int = 256
    ffn: int = 1024
    seed: int = 0
    repeats: int = DEFAULT_REPEATS
    warmup: int = 3
    json_path: str | None = None
    log_dir: str | None = None
    keep: bool = False
    plot_path: str | None = None


def baseline_name(backend: str) -> str:
    """What the allreduce is compared with: NCCL on cuda, the host backend's shared-memory collectives."""
    return "nccl" if backend == "cuda" else "shm"


def validate(a: TpBenchArgs) -> None:
    if a.nprocs < 2:
        raise UsageError(f"tp compares N ranks with one: -n must be at least 2, got {a.nprocs}")
    if a.ffn % (8 * a.nprocs) or a.hidden % 8:
        raise UsageError(
            f"--ffn ({a.ffn}) must split into {a.nprocs} shards of a multiple of 8 and --hidden "
            f"({a.hidden}) be a multiple of 8 (16-byte vectors)"
        )
    bad = [s for s in a.sizes if s < 16 or s % 16]
    if bad:
        raise UsageError(f"--sizes must be multiples of 16 bytes (8 bf16), got {bad}")


def _launch(a: TpBenchArgs, nprocs: int, work: Path, name: str) -> list[dict[str, Any]]:
    """One tray of the rank program; returns every rank's result. Raises TrayFailed with the root cause."""
    cfg = {
        "hidden": a.hidden,
        "ffn": a.ffn,
        "seed": a.seed,
        "sizes": list(a.sizes),
        "repeats": a.repeats,
        "warmup": a.warmup,
        "target_s": 2e-3 if a.backend == "cuda" else 0.0,
    }
    return run_rank_program(name, "tray.programs.tp_mlp.rank_program", cfg, work, nprocs=nprocs, backend=a.backend,
                            manifest=str(builtin_path(MANIFEST)), vars=launch_vars(a, nprocs), log_dir=a.log_dir)


def launch_vars(a: TpBenchArgs, nprocs: int) -> dict[str, int]:
    """The manifest vars of a tray of `nprocs` ranks: buffers sized for the largest message."""
    max_tokens = max(1, max(s // 2 for s in a.sizes) // a.hidden)
    return {"hidden": a.hidden, "ffn_local": a.ffn // nprocs, "max_tokens": max_tokens, "tokens": max_tokens,
            "count": max_tokens * a.hidden}


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    from tray.dtypes import bf16_bits_to_f32

    g = bf16_bits_to_f32(got).astype(np.float64)
    w = bf16_bits_to_f32(want).astype(np.float64)
    rel = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
    return rel if np.isfinite(rel) else float("nan")


def summarize(a: TpBenchArgs, per_rank: list[dict[str, Any]], one: dict[str, Any], work: Path) -> list[dict]:
    rows = []
    for i, size in enumerate(a.sizes):
        entries = [r["sizes"][i] for r in per_rank]
        e0 = entries[0]
        us = {k: max(e["us"][k] for e in entries) for k in e0["us"]}
        checks: dict[str, Any] = {
            "peer_exact": all(e["allreduce"]["peer_exact"] for e in entries),
            "peer_identical_on_all_ranks": e0["allreduce"]["peer_identical_on_all_ranks"],
            "nccl_rel_err": max(e["allreduce"]["nccl_rel_err"] for e in entries),
            "nccl_ok": all(e["allreduce"]["nccl_ok"] for e in entries),
        }
        ok = checks["peer_exact"] and checks["peer_identical_on_all_ranks"] and checks["nccl_ok"]
        if e0["tokens"]:
            ref = np.load(work / "one" / f"S{size}_peer.npy")
            peer = np.load(work / "tp" / f"S{size}_peer.npy")
            nccl = np.load(work / "tp" / f"S{size}_nccl.npy")
            checks["mlp_peer_vs_one_gpu_rel_err"] = _rel(peer, ref)
            checks["mlp_nccl_vs_one_gpu_rel_err"] = _rel(nccl, ref)
            checks["mlp_peer_identical_on_all_ranks"] = all(
                e["mlp"]["peer_identical_on_all_ranks"] for e in entries
            )
            checks["mlp_nan_rows"] = (
                sum(e["mlp"]["nan_rows"] for e in entries) + one["sizes"][i]["mlp"]["nan_rows"]
            )
            us["mlp_one_gpu"] = one["sizes"][i]["us"]["mlp_peer"]
            ok = (
                ok
                and checks["mlp_peer_identical_on_all_ranks"]
                and checks["mlp_nan_rows"] == 0
                and all(
                    not math.isnan(checks[k]) and checks[k] <= MLP_TOLERANCE
                    for k in ("mlp_peer_vs_one_gpu_rel_err", "mlp_nccl_vs_one_gpu_rel_err")
                )
            )
        checks["passed"] = bool(ok)
        ratios = {"ar_peer_vs_nccl": us["ar_peer"] / us["ar_nccl"]}
        if "mlp_peer" in us:
            ratios["mlp_peer_vs_nccl"] = us["mlp_peer"] / us["mlp_nccl"]
        rows.append(
            {
                "bytes": size,
                "count": e0["count"],
                "tokens": e0["tokens"],
                "us": us,
                "ratios": ratios,
                "checks": checks,
            }
        )
    return rows


def print_report(report: dict[str, Any]) -> None:
    base = baseline_name(report["backend"])
    one = "1gpu" if report["backend"] == "cuda" else "1rank"
    print(
        f"tp: {report['nprocs']} ranks, {report['backend']} backend; MLP hidden {report['hidden']}, ffn "
        f"{report['ffn']} ({report['ffn'] // report['nprocs']} per rank); µs per call, captured, slowest rank; "
        f"baseline {base} ({'NCCL' if base == 'nccl' else 'the host backend’s shared-memory collectives'})"
    )
    print(
        f"  {'bytes':>9} {'ar peer':>9} {'ar ' + base:>9} {'ratio':>6} {'tokens':>7} {'mlp peer':>9} "
        f"{'mlp ' + base:>9} {'mlp ' + one:>9}  check"
    )
    for r in report["sizes"]:
        u = r["us"]
        mlp = (
            f"{r['tokens']:>7} {u['mlp_peer']:>9.1f} {u['mlp_nccl']:>9.1f} {u['mlp_one_gpu']:>9.1f}"
            if r["tokens"]
            else f"{'-':>7} {'-':>9} {'-':>9} {'-':>9}"
        )
        print(
            f"  {r['bytes']:>9} {u['ar_peer']:>9.2f} {u['ar_nccl']:>9.2f} "
            f"{r['ratios']['ar_peer_vs_nccl']:>6.2f} {mlp}  {'ok' if r['checks']['passed'] else 'FAILED'}"
        )
    print(format_table(allreduce_rows(report)))
    print("PASSED" if report["passed"] else "FAILED")


def allreduce_rows(report: dict[str, Any]) -> list[Row]:
    """Both allreduces per size as nccl-tests rows (bf16, busbw factor 2(n-1)/n; #wrong: 0 or the count
    when the size's check failed)."""
    rows = []
    names = {"ar_peer": "allreduce peer", "ar_nccl": f"allreduce {baseline_name(report['backend'])}"}
    for r in report["sizes"]:
        wrong = 0 if r["checks"]["passed"] else r["count"]
        for path, name in names.items():
            rows.append(Row(name, r["bytes"], r["count"], "bf16", r["us"][path], wrong, "allreduce",
                            report["nprocs"]))
    return rows


def plot(report: dict[str, Any], path: str) -> None:
    """Latency vs message size: both allreduces (and the MLP where it ran), µs, log-log."""
    base = baseline_name(report["backend"])
    series: dict[str, tuple[list[float], list[float]]] = {}
    for key, label in (("ar_peer", "allreduce peer"), ("ar_nccl", f"allreduce {base}"),
                       ("mlp_peer", "MLP peer"), ("mlp_nccl", f"MLP {base}")):
        points = [(r["bytes"], r["us"][key]) for r in report["sizes"] if key in r["us"]]
        if points:
            series[label] = ([x for x, _ in points], [y for _, y in points])
    plot_lines(path, series, title=f"tp: {report['nprocs']} ranks, {report['backend']} backend",
               xlabel="message size (bytes)", ylabel="µs per call")


def run_tp_bench(a: TpBenchArgs) -> int:
    """Check, time, print, write JSON. Returns the exit code: 0 passed, 1 failed."""
    validate(a)
    require_plot(a.plot_path)
    work = Path(tempfile.mkdtemp(prefix="tray-tp-"))
    try:
        try:
            mib = buffers_nbytes(str(builtin_path(MANIFEST)), a.nprocs, launch_vars(a, a.nprocs)) / (1 << 20)
            t0 = stage("tp", 1, 2, f"{a.nprocs} ranks: {len(a.sizes)} sizes, {a.sizes[0]} .. {a.sizes[-1]} B, "
                                   f"{a.repeats} repeats each, {mib:.1f} MiB of buffers per rank "
                                   "(a line per size from rank 0)")
            per_rank = _launch(a, a.nprocs, work, "tp")
            t1 = stage("tp", 2, 2, f"1 rank: the full MLP for the reference ({time.monotonic() - t0:.1f} s so far)")
            one = _launch(a, 1, work, "one")[0]
            print(f"tp: done in {time.monotonic() - t0:.1f} s (reference {time.monotonic() - t1:.1f} s)", flush=True)
        except TrayFailed as exc:
            print(f"tp: {exc}", file=sys.stderr)
            return 1
        sizes = summarize(a, per_rank, one, work)
    finally:
        if a.keep:
            print(f"tp: work files kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report = {
        "bench": "tp",
        "nprocs": a.nprocs,
        "backend": a.backend,
        "hidden": a.hidden,
        "ffn": a.ffn,
        "seed": a.seed,
        "repeats": a.repeats,
        "sizes": sizes,
        "passed": all(s["checks"]["passed"] for s in sizes),
        "setup_s": max(r["setup_s"] for r in per_rank),
    }
    print_report(report)
    write_report(report, a.json_path, {"device": per_rank[0].get("device")})
    if a.plot_path:
        plot(report, a.plot_path)
        print(f"tp: plot in {a.plot_path}")
    return 0 if report["passed"] else 1
