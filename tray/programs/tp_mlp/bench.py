"""`tray bench tp`: a tensor-parallel MLP reduced by a one-shot peer allreduce vs NCCL allreduce.

    tray bench tp -n 4 [--sizes 512,1024,...,4194304] [--hidden 256] [--ffn 1024] [--backend] [--json PATH]

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tray.bench import Row, TrayFailed, format_table, run_rank_program, write_report
from tray.errors import UsageError
from tray.manifest.builtin import builtin_path

MANIFEST = "tp_mlp"  # built-in (package data), see tray.manifest.builtin
DEFAULT_SIZES = tuple(512 << i for i in range(14))  # 512 B .. 4 MiB
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
    repeats: int = 20
    warmup: int = 3
    json_path: str | None = None
    log_dir: str | None = None
    keep: bool = False


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
    max_count = max(s // 2 for s in a.sizes)
    max_tokens = max(1, max_count // a.hidden)
    cfg = {
        "hidden": a.hidden,
        "ffn": a.ffn,
        "seed": a.seed,
        "sizes": list(a.sizes),
        "repeats": a.repeats,
        "warmup": a.warmup,
        "target_s": 2e-3 if a.backend == "cuda" else 0.0,
    }
    launch_vars = {
        "hidden": a.hidden,
        "ffn_local": a.ffn // nprocs,
        "max_tokens": max_tokens,
        "tokens": max_tokens,
        "count": max_tokens * a.hidden,
    }
    return run_rank_program(name, "tray.programs.tp_mlp.rank_program", cfg, work, nprocs=nprocs, backend=a.backend,
                            manifest=str(builtin_path(MANIFEST)), vars=launch_vars, log_dir=a.log_dir)


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
    print(
        f"tp: {report['nprocs']} ranks, {report['backend']} backend; MLP hidden {report['hidden']}, ffn "
        f"{report['ffn']} ({report['ffn'] // report['nprocs']} per rank); µs per call, captured, slowest rank"
    )
    print(
        f"  {'bytes':>9} {'ar peer':>9} {'ar nccl':>9} {'ratio':>6} {'tokens':>7} {'mlp peer':>9} "
        f"{'mlp nccl':>9} {'mlp 1gpu':>9}  check"
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
    for r in report["sizes"]:
        wrong = 0 if r["checks"]["passed"] else r["count"]
        for path in ("ar_peer", "ar_nccl"):
            rows.append(Row(path, r["bytes"], r["count"], "bf16", r["us"][path], wrong, "allreduce",
                            report["nprocs"]))
    return rows


def run_tp_bench(a: TpBenchArgs) -> int:
    """Check, time, print, write JSON. Returns the exit code: 0 passed, 1 failed."""
    validate(a)
    work = Path(tempfile.mkdtemp(prefix="tray-tp-"))
    try:
        try:
            per_rank = _launch(a, a.nprocs, work, "tp")
            one = _launch(a, 1, work, "one")[0]
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
    return 0 if report["passed"] else 1
