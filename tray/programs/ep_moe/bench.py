"""`tray bench ep-moe`: the EP MoE layer over peer buffers vs NCCL all-to-all vs EP1, checked, then timed.

    tray bench ep-moe -n 4 [--tokens 128,4096] [--hidden 7168] [--experts 256] [--topk 8]
                      [--expert-dim 2048] [--backend cuda|host] [--json PATH] [--plot PATH]

The head (this module) draws the routing for every token count from a seed, places it on N ranks and on
one (tray/programs/ep_moe/plan.py), writes each rank's index arrays, then launches two trays of
manifests/ep_moe.json running tray/programs/ep_moe/rank_program.py: N ranks (peer path, NCCL path, copy ceiling)
and 1 rank (EP1, same global tokens). Checks: EP-N rows equal EP1 rows byte for byte (both paths), EP1
within bf16 tolerance of a float64 reference on a few tokens, no NaN, no overflowed route, the counts
every rank received. Exit 1 if a check fails.
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

from tray.bench import TrayFailed, plot_lines, require_plot, run_rank_program, write_report
from tray.errors import UsageError
from tray.manifest.builtin import builtin_path

MANIFEST = "ep_moe"  # built-in (package data), see tray.manifest.builtin
# NOTE: bf16 operands and three bf16 roundings on the way (h13, act, expert output): a few 1e-3 expected.
REF_TOLERANCE = 2e-2
PHASES = ("dispatch", "experts", "combine", "reduce", "layer")


@dataclass(frozen=True)
class EpBenchArgs:
    nprocs: int
    backend: str
    tokens: tuple[int, ...] = (128, 4096)
    hidden: int = 7168
    experts: int = 256
    topk: int = 8
    expert_dim: int = 2048
    seed: int = 0
    cap: int | None = None
    repeats: int = 10
    warmup: int = 2
    ref_tokens: int = 4
    json_path: str | None = None
    plot_path: str | None = None
    log_dir: str | None = None
    keep: bool = False


def validate(a: EpBenchArgs) -> None:
    """UsageError for shapes the kernels or the comparison cannot take."""
    if a.nprocs < 2:
        raise UsageError(f"ep-moe compares N ranks with EP1: -n must be at least 2, got {a.nprocs}")
    if a.experts % a.nprocs:
        raise UsageError(f"--experts {a.experts} must divide over {a.nprocs} ranks")
    if a.hidden % 8 or a.expert_dim % 8:
        raise UsageError(
            f"--hidden ({a.hidden}) and --expert-dim ({a.expert_dim}) must be multiples of 8 "
            "(rows move as 16-byte vectors)"
        )
    if not 1 <= a.topk <= a.experts:
        raise UsageError(f"--topk must be in 1..{a.experts}, got {a.topk}")
    if not a.tokens or min(a.tokens) < 1:
        raise UsageError(f"--tokens needs positive counts, got {a.tokens}")
    for t in a.tokens:
        if (t * a.topk) % a.nprocs:
            raise UsageError(
                f"tokens {t} x topk {a.topk} must divide over {a.nprocs} ranks (the copy ceiling "
                "sends equal chunks)"
            )


def prepare(a: EpBenchArgs, work: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, int]]:
    """Plans and index arrays for every token count: (EP-N runs, EP1 runs, launch vars of EP-N)."""
    from tray.programs.ep_moe.plan import plan_ep, random_routing

    G = a.nprocs
    runs_n, runs_1 = [], []
    for T in a.tokens:
        routing = random_routing(G * T, a.experts, a.topk, seed=a.seed * 1_000_003 + T)
        plan_n = plan_ep(routing, G, cap=a.cap)
        plan_1 = plan_ep(routing, 1, cap=plan_n.cap)
        d = work / f"T{T}"
        d.mkdir()
        for r in range(G):
            np.savez(d / f"r{r}.npz", **vars(plan_n.rank_inputs(r)))
        ep1 = vars(plan_1.rank_inputs(0))
        del ep1["pack_row"], ep1["unpack_row"]
        np.savez(d / "ep1.npz", **ep1)
        n_ref = min(a.ref_tokens, G * T)
        ref = sorted({int(i) for i in np.linspace(0, G * T - 1, n_ref).round()}) if n_ref else []
        runs_n.append({"label": T, "tokens": T, "cap": plan_n.cap, "capp": plan_n.capp, "inputs": str(d)})
        runs_1.append(
            {"label": T, "tokens": G * T, "cap": plan_n.cap, "capp": 8, "inputs": str(d), "ref_tokens": ref}
        )
    shape = {"hidden": a.hidden, "experts": a.experts, "topk": a.topk, "ffn": a.expert_dim}
    launch_n = launch_vars(
        shape, max(a.tokens), max(r["cap"] for r in runs_n), max(r["capp"] for r in runs_n)
    )
    return runs_n, runs_1, launch_n


def launch_vars(shape: dict[str, int], max_tokens: int, max_cap: int, max_capp: int) -> dict[str, int]:
    """Vars a tray is launched with: buffers are sized by the max_* ones; the run-time ones (tokens, cap,
    capp) start at their maxima so every program resolves at launch."""
    return {
        **shape,
        "max_tokens": max_tokens,
        "max_cap": max_cap,
        "max_capp": max_capp,
        "tokens": max_tokens,
        "cap": max_cap,
        "capp": max_capp,
    }


def launch(
    a: EpBenchArgs,
    nprocs: int,
    runs: list[dict[str, Any]],
    launch_vars: dict[str, int],
    work: Path,
    name: str,
) -> list[dict[str, Any]]:
    """One tray of the rank program; returns every rank's result. Raises TrayFailed with the root cause."""
    cfg = {
        "hidden": a.hidden,
        "experts": a.experts,
        "topk": a.topk,
        "ffn": a.expert_dim,
        "seed": a.seed,
        "repeats": a.repeats,
        "warmup": a.warmup,
        "target_s": 2e-3 if a.backend == "cuda" else 0.0,
        "runs": runs,
    }
    return run_rank_program(name, "tray.programs.ep_moe.rank_program", cfg, work, nprocs=nprocs, backend=a.backend,
                            manifest=str(builtin_path(MANIFEST)), vars=launch_vars, log_dir=a.log_dir)


def _slowest(per_rank: list[dict[str, Any]], index: int, key: str) -> float:
    vals = [r["runs"][index]["us"][key] for r in per_rank if key in r["runs"][index]["us"]]
    vals = [v for v in vals if not math.isnan(v)]  # NaN: a figure a rank could not take
    return max(vals) if vals else float("nan")


def summarize(a: EpBenchArgs, per_rank: list[dict[str, Any]], ep1: dict[str, Any], work: Path) -> list[dict]:
    G, K, H = a.nprocs, a.topk, a.hidden
    runs = []
    for i, T in enumerate(a.tokens):
        e1 = ep1["runs"][i]
        ref_out = np.load(work / "ep1" / f"T{T}_ep1.npy")
        peer = np.concatenate([np.load(work / "epn" / f"T{T}_peer_r{r}.npy") for r in range(G)])
        nccl = np.concatenate([np.load(work / "epn" / f"T{T}_nccl_r{r}.npy") for r in range(G)])
        rank_checks = [r["runs"][i]["checks"] for r in per_rank]
        checks = {
            "rows": G * T,
            "peer_rows_differ_from_ep1": int((peer != ref_out).any(axis=1).sum()),
            "nccl_rows_differ_from_ep1": int((nccl != ref_out).any(axis=1).sum()),
            "ep1_vs_float64_rel_err": e1.get("reference", {}).get("rel_err"),
            "ep1_ref_tokens": e1.get("reference", {}).get("ref_tokens"),
            "route_errors": [c["err_words"][:2] for c in rank_checks] + [e1["checks"]["err_words"][:2]],
            "recv_counts_ok": all(c["recv_counts_ok"] for c in rank_checks)
            and e1["checks"]["recv_counts_ok"],
            "nan_rows": sum(c["peer_nan_rows"] + c["nccl_nan_rows"] for c in rank_checks)
            + e1["checks"]["peer_nan_rows"],
        }
        rel = checks["ep1_vs_float64_rel_err"]
        checks["passed"] = bool(
            checks["peer_rows_differ_from_ep1"] == 0
            and checks["nccl_rows_differ_from_ep1"] == 0
            and (rel is None or (not math.isnan(rel) and rel <= REF_TOLERANCE))
            and all(e == [0, 0] for e in checks["route_errors"])
            and checks["recv_counts_ok"]
            and checks["nan_rows"] == 0
        )
        us = {
            "peer": {p: _slowest(per_rank, i, p) for p in PHASES},
            "nccl": {
                p: _slowest(per_rank, i, k)
                for p, k in (
                    ("dispatch", "dispatch_nccl"),
                    ("experts", "experts"),
                    ("combine", "combine_nccl"),
                    ("reduce", "reduce"),
                    ("layer", "layer_nccl"),
                )
            },
            "ep1": {p: e1["us"][p] for p in PHASES},
            "ceiling_kernel": _slowest(per_rank, i, "ceiling"),
            "ceiling_ce": _slowest(per_rank, i, "ceiling_ce"),
        }
        nbytes = T * K * H * 2  # rows one rank sends in a dispatch (and receives back in a combine)
        ceiling_us = np.nanmin([us["ceiling_kernel"], us["ceiling_ce"]])
        gbps = {
            "bytes_per_rank": nbytes,
            "dispatch": nbytes / us["peer"]["dispatch"] / 1e3,
            "combine": nbytes / us["peer"]["combine"] / 1e3,
            "ceiling": nbytes / ceiling_us / 1e3,
        }
        gbps["dispatch_vs_ceiling"] = gbps["dispatch"] / gbps["ceiling"]
        gbps["combine_vs_ceiling"] = gbps["combine"] / gbps["ceiling"]
        dc_peer = us["peer"]["dispatch"] + us["peer"]["combine"]
        dc_nccl = us["nccl"]["dispatch"] + us["nccl"]["combine"]
        ratios = {
            "peer_dispatch_combine_vs_nccl": dc_peer / dc_nccl,
            "peer_layer_vs_nccl_layer": us["peer"]["layer"] / us["nccl"]["layer"],
            "epn_layer_vs_ep1_layer": us["peer"]["layer"] / us["ep1"]["layer"],
        }
        runs.append(
            {
                "tokens_per_rank": T,
                "global_tokens": G * T,
                "cap": e1["cap"],
                "capp": per_rank[0]["runs"][i]["capp"],
                "checks": checks,
                "us": us,
                "gbps": gbps,
                "ratios": ratios,
            }
        )
    return runs


def print_report(report: dict[str, Any]) -> None:
    s = report["shape"]
    G = report["nprocs"]
    print(
        f"ep-moe: {G} ranks, {report['backend']} backend; hidden {s['hidden']}, {s['experts']} experts "
        f"({s['experts'] // G} per rank), top-{s['topk']}, expert dim {s['ffn']}; µs, slowest rank, median"
    )
    head = ("dispatch", "experts", "combine", "reduce", "layer")
    print(f"  {'tokens/rank':>11} {'path':<5} " + " ".join(f"{h:>9}" for h in head))
    for run in report["runs"]:
        for path in ("peer", "nccl", "ep1"):
            u = run["us"][path]
            label = f"EP{G}" if path == "peer" else path
            print(f"  {run['tokens_per_rank']:>11} {label:<5} " + " ".join(f"{u[h]:>9.1f}" for h in head))
        g, r, c = run["gbps"], run["ratios"], run["checks"]
        print(
            f"  {'':>11} dispatch {g['dispatch']:.1f} GB/s, combine {g['combine']:.1f} GB/s vs copy ceiling "
            f"{g['ceiling']:.1f} GB/s ({g['dispatch_vs_ceiling']:.2f}x, {g['combine_vs_ceiling']:.2f}x)"
        )
        print(
            f"  {'':>11} peer d+c / NCCL d+c {r['peer_dispatch_combine_vs_nccl']:.2f}; EP{G} layer / EP1 "
            f"layer {r['epn_layer_vs_ep1_layer']:.2f}; peer layer / NCCL layer "
            f"{r['peer_layer_vs_nccl_layer']:.2f}"
        )
        rel = c["ep1_vs_float64_rel_err"]
        rel_text = "not checked" if rel is None else f"{rel:.2e} on {len(c['ep1_ref_tokens'])} tokens"
        print(
            f"  {'':>11} checks: rows differing from EP1: peer {c['peer_rows_differ_from_ep1']}/{c['rows']}, "
            f"NCCL {c['nccl_rows_differ_from_ep1']}/{c['rows']}; EP1 vs float64 {rel_text}; "
            f"{'PASSED' if c['passed'] else 'FAILED'}"
        )
    print("PASSED" if report["passed"] else "FAILED")


def plot(report: dict[str, Any], path: str) -> None:
    """Latency vs tokens per rank: the layer on each path, and dispatch+combine of peer and NCCL."""
    G = report["nprocs"]
    runs = report["runs"]
    xs = [r["tokens_per_rank"] for r in runs]
    s = report["shape"]
    plot_lines(
        path,
        {
            f"EP{G} peer layer": (xs, [r["us"]["peer"]["layer"] for r in runs]),
            f"EP{G} NCCL layer": (xs, [r["us"]["nccl"]["layer"] for r in runs]),
            "EP1 layer": (xs, [r["us"]["ep1"]["layer"] for r in runs]),
            "peer dispatch+combine": (xs, [r["us"]["peer"]["dispatch"] + r["us"]["peer"]["combine"] for r in runs]),
            "NCCL dispatch+combine": (xs, [r["us"]["nccl"]["dispatch"] + r["us"]["nccl"]["combine"] for r in runs]),
        },
        title=f"EP MoE, {G} ranks: H {s['hidden']}, {s['experts']} experts, top-{s['topk']}",
        xlabel="tokens per rank",
        ylabel="µs (captured, median)",
    )
    print(f"ep-moe: plot written to {path}")


def run_ep_bench(a: EpBenchArgs) -> int:
    """Check, time, print, write JSON (and a plot). Returns the exit code: 0 passed, 1 failed."""
    validate(a)
    require_plot(a.plot_path)
    work = Path(tempfile.mkdtemp(prefix="tray-ep-moe-"))
    try:
        runs_n, runs_1, launch_n = prepare(a, work)
        shape = {k: launch_n[k] for k in ("hidden", "experts", "topk", "ffn")}
        launch_1 = launch_vars(shape, a.nprocs * max(a.tokens), launch_n["max_cap"], 8)
        try:
            per_rank = launch(a, a.nprocs, runs_n, launch_n, work, "epn")
            ep1 = launch(a, 1, runs_1, launch_1, work, "ep1")[0]
        except TrayFailed as exc:
            print(f"ep-moe: {exc}", file=sys.stderr)
            return 1
        runs = summarize(a, per_rank, ep1, work)
    finally:
        if a.keep:
            print(f"ep-moe: work files kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report = {
        "bench": "ep-moe",
        "nprocs": a.nprocs,
        "backend": a.backend,
        "shape": {"hidden": a.hidden, "experts": a.experts, "topk": a.topk, "ffn": a.expert_dim},
        "seed": a.seed,
        "repeats": a.repeats,
        "runs": runs,
        "passed": all(r["checks"]["passed"] for r in runs),
        "setup_s": {"epn": max(r["setup_s"] for r in per_rank), "ep1": ep1["setup_s"]},
    }
    print_report(report)
    write_report(report, a.json_path, {"device": per_rank[0].get("device")})
    if a.plot_path:
        plot(report, a.plot_path)
    return 0 if report["passed"] else 1
