"""`tray bench tp`: the peer allreduces (low-latency, one-shot, two-shot) vs NCCL's, and a TP MLP layer.

    tray bench tp -n 4 [--sizes 8,16,...,67108864] [--tokens 1,4,...,4096] [--hidden 8192] [--ffn 28672]
                  [--ll-max-bytes N] [--ll-sweep-bytes N] [--ll-shapes SPEC] [--nnodes K] [--backend] [--json PATH]
                  [--plot PNG]

Two trays of manifests/tp_mlp.json running tray/programs/tp_mlp/rank_program.py: N ranks (the allreduce
sweep, nccl-tests shaped: every path timed captured and checked on what its timed replays left; then the
TP layer per token count), then 1 rank (the full layer on one GPU: the reference for the TP outputs and
the TP-N vs one-GPU time). The low-latency one-shot (flags carried in the data) is timed in both line formats
(`ar_ll`: 2 bf16 and a 32-bit flag per 8-byte word; `ar_ll3`: 3 bf16 and a 16-bit flag, 1.5x fewer bytes
sent) at every size up to --ll-sweep-bytes, past the size the tray sends through it (manifest var
ll_max_bytes), so the crossover is visible: `ll_wins_up_to_bytes` is the largest size up to which its faster
format beat both other peer paths at every size. `ar_peer` per size is the path the tray uses there
(`ar_peer_path`): the faster low-latency format measured in this run up to ll_max_bytes, above it the faster
of the one-shot and the two-shot measured in this run (`crossover` gives the smallest size from which the
two-shot wins at every larger size). `ar_tray` is what the tray's allreduce does with that table: the peer
path, or NCCL at the sizes where NCCL measured faster (`ar_tray_path`), so it is never slower than NCCL by
construction; the report lists those sizes. With --ll-shapes, the low-latency path is also timed at each
other launch shape (threads per block, lines per thread, line format; `ar_ll` and `ar_ll3` are the manifest's
shape) wherever it is timed: keys `ar_ll[t512,l2]`, `ar_ll3[t128,l1]` in us and checks.wrong, and `ll_shapes`
names the fastest shape per size. Exit 1 if a check fails.

With --nnodes K (K >= 2) the N-rank tray is a job of K nodes on this machine (tray/bench/nodes.py: one
`tray launch --nnodes K` per node, N / K ranks each, on cuda its share of the GPUs and its own NCCL_HOSTID).
TP runs within each node (the manifest's group `node`): every node is one TP group of N / K ranks (ffn split
N / K ways) whose peer mappings, barriers and NCCL baseline never leave the node; every node computes the
same layer, so the checks are those of one node, on every rank of the job, plus `tp_within_nodes`: every
rank's TP group was the ranks of its node. The report says `"nnodes"`, `"tp_size"` and `"tp_groups"`.
"""

from __future__ import annotations

import math
import sys
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
from tray.launch.jobdir import work_dir
from tray.manifest.builtin import builtin_path
from tray.programs.tp_mlp.defaults import DEFAULTS
from tray.programs.tp_mlp.ll import LLShape

MANIFEST = "tp_mlp"  # built-in (package data), see tray.manifest.builtin
# NOTE: the nccl-tests range 8 B .. 64 MiB on a GPU; the layer of a 70B-class model (hidden 8192, ffn
# 28672 split over the ranks) at 1 .. 4096 tokens. The host backend sums and multiplies in numpy: the
# same flow at sizes that finish in well under a minute on 2 cores, a few MB per rank.
# NOTE: the low-latency path's slots hold 2x its bytes per member and parity: ll_sweep_bytes 4 MiB at 8 ranks is
# 128 MiB
# NOTE: the TP partials are rounded to bf16 before the sum; one GPU rounds once: a few bf16 ulps apart.
MLP_TOLERANCE = 2e-2
PEER_PATHS = ("ar_oneshot", "ar_twoshot")
LL_PATH = "ar_ll"  # the low-latency one-shot, 2 bf16 and a 32-bit flag per 8-byte word
LL3_PATH = "ar_ll3"  # the same with dense lines: 3 bf16 and a 16-bit flag per word (1.5x fewer bytes sent)
LL_PATHS = (LL_PATH, LL3_PATH)
NCCL_PATHS = ("ar_nccl", "ar_nccl_win")  # NCCL plain, and on buffers registered as symmetric windows (cuda)


@dataclass(frozen=True)
class TpBenchArgs:
    nprocs: int
    backend: str
    sizes: tuple[int, ...] | None = None  # None: DEFAULTS[backend]
    tokens: tuple[int, ...] | None = None
    hidden: int | None = None
    ffn: int | None = None
    seed: int = 0
    repeats: int | None = None
    warmup: int = 3
    json_path: str | None = None
    log_dir: str | None = None
    keep: bool = False
    plot_path: str | None = None
    ll_max_bytes: int | None = None  # None: the manifest's ll_max_bytes
    ll_sweep_bytes: int | None = None  # None: DEFAULTS[backend]
    ll_shapes: tuple[LLShape, ...] = ()  # launch shapes of the low-latency path timed beside the manifest's
    nnodes: int = 1  # nodes of the N-rank job (TP within each node: nprocs // nnodes ranks per TP group)
    nccl_windows: bool = True  # cuda: also time NCCL on buffers registered as symmetric windows (ar_nccl_win)

    @property
    def tp_size(self) -> int:
        """Ranks per TP group: the ranks of one node."""
        return self.nprocs // self.nnodes

    def resolved(self) -> TpBenchArgs:
        """Every None replaced by the backend's default."""
        d = DEFAULTS.get(self.backend, DEFAULTS["host"])
        return TpBenchArgs(
            nprocs=self.nprocs, backend=self.backend, sizes=self.sizes or d["sizes"],
            tokens=self.tokens or d["tokens"], hidden=d["hidden"] if self.hidden is None else self.hidden,
            ffn=d["ffn"] if self.ffn is None else self.ffn,
            seed=self.seed, repeats=d["repeats"] if self.repeats is None else self.repeats, warmup=self.warmup,
            json_path=self.json_path,
            log_dir=self.log_dir, keep=self.keep, plot_path=self.plot_path, ll_max_bytes=self.ll_max_bytes,
            ll_sweep_bytes=d["ll_sweep_bytes"] if self.ll_sweep_bytes is None else self.ll_sweep_bytes,
            ll_shapes=self.ll_shapes, nnodes=self.nnodes, nccl_windows=self.nccl_windows)


def baseline_name(backend: str) -> str:
    """What the allreduce is compared with: NCCL on cuda, the host backend's shared-memory collectives."""
    return "nccl" if backend == "cuda" else "shm"


def validate(a: TpBenchArgs) -> None:
    from tray.bench.nodes import check_nnodes

    assert a.sizes is not None and a.tokens is not None and a.hidden is not None and a.ffn is not None
    check_nnodes(a.nnodes, a.nprocs)
    if a.tp_size < 2:
        raise UsageError(f"tp compares a TP group of the ranks of a node with one rank: -n / --nnodes must be at "
                         f"least 2, got -n {a.nprocs} over {a.nnodes} node(s)")
    if a.nnodes > 1 and a.plot_path:
        raise UsageError("--plot draws one tray's sweep; run without --nnodes to plot")
    if a.repeats is not None and a.repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {a.repeats}")
    if a.ffn < 8 * a.tp_size or a.hidden < 8 or a.ffn % (8 * a.tp_size) or a.hidden % 8:
        raise UsageError(
            f"--ffn ({a.ffn}) must split into {a.tp_size} shards (the ranks of a node) of a positive multiple of 8 "
            f"and --hidden ({a.hidden}) be a positive multiple of 8 (16-byte vectors)"
        )
    bad = [s for s in a.sizes if s < 2 or s % 2]
    if bad:
        raise UsageError(f"--sizes must be whole bf16 elements (even byte counts >= 2), got {bad}")
    bad = [s for s in a.sizes if s > 1 << 40]
    if bad:
        raise UsageError(f"--sizes are bytes per allreduce, at most 2**40 (more than any GPU holds), got {bad}")
    for flag, values, most in (("--tokens", a.tokens, 1 << 24), ("--hidden", (a.hidden,), 1 << 20),
                               ("--ffn", (a.ffn,), 1 << 24)):
        if max(values) > most:
            raise UsageError(f"{flag} takes at most {most}, got {max(values)}")
    if any(t < 1 for t in a.tokens):
        raise UsageError(f"--tokens must be >= 1, got {list(a.tokens)}")
    for flag, value in (("--ll-max-bytes", a.ll_max_bytes), ("--ll-sweep-bytes", a.ll_sweep_bytes)):
        if value is not None and value < 0:
            raise UsageError(f"{flag} must be >= 0 bytes, got {value}")


def _launch(a: TpBenchArgs, nprocs: int, work: Path, name: str) -> list[dict[str, Any]]:
    """One tray of the rank program; returns every rank's result. Raises TrayFailed with the root cause."""
    assert a.sizes is not None and a.tokens is not None
    cfg = {
        "hidden": a.hidden,
        "ffn": a.ffn,
        "seed": a.seed,
        "sizes": list(a.sizes) if nprocs > 1 else [],
        "tokens": list(a.tokens),
        "repeats": a.repeats,
        "warmup": a.warmup,
        "target_s": 2e-3 if a.backend == "cuda" else 0.0,
        "ll_sweep_bytes": a.ll_sweep_bytes,
        "ll_shapes": [[s.threads, s.lines, s.program] for s in a.ll_shapes],
        "nccl_windows": a.nccl_windows,
    }
    if nprocs > 1 and a.nnodes > 1:
        from tray.bench.nodes import NodeJob, run_rank_program_nodes

        job = NodeJob(name=name, module="tray.programs.tp_mlp.rank_program", nnodes=a.nnodes, nprocs=nprocs,
                      backend=a.backend, manifest=str(builtin_path(MANIFEST)), vars=launch_vars(a, a.tp_size),
                      log_dir=a.log_dir)
        return run_rank_program_nodes(job, cfg, work)
    return run_rank_program(name, "tray.programs.tp_mlp.rank_program", cfg, work, nprocs=nprocs, backend=a.backend,
                            manifest=str(builtin_path(MANIFEST)), vars=launch_vars(a, nprocs), log_dir=a.log_dir)


def launch_vars(a: TpBenchArgs, nprocs: int) -> dict[str, int]:
    """The manifest vars of a TP group of `nprocs` ranks (the ranks of a node): buffers sized for the largest
    message and token count, ffn split `nprocs` ways."""
    assert a.sizes is not None and a.tokens is not None and a.hidden is not None and a.ffn is not None
    max_tokens = max(a.tokens)
    max_count = max(max_tokens * a.hidden, *(s // 2 for s in a.sizes))
    # the low-latency slots: the largest message it is timed at (sweep sizes and layer outputs within
    # --ll-sweep-bytes), in whole lines of 4 elements
    layer_bytes = [t * a.hidden * 2 for t in a.tokens]
    ll_sizes = [s for s in (*a.sizes, *layer_bytes) if s <= (a.ll_sweep_bytes or 0)]
    ll_max_count = -(-max(ll_sizes, default=8) // 8) * 4
    out = {"hidden": a.hidden, "ffn_local": a.ffn // nprocs, "max_tokens": max_tokens, "tokens": max_tokens,
           "max_count": max_count, "count": max_count, "ll_max_count": ll_max_count}
    if a.ll_max_bytes is not None:
        out["ll_max_bytes"] = a.ll_max_bytes
    return out


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    from tray.dtypes import bf16_bits_to_f32

    g = bf16_bits_to_f32(got).astype(np.float64)
    w = bf16_bits_to_f32(want).astype(np.float64)
    rel = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
    return rel if np.isfinite(rel) else float("nan")


def summarize_sizes(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per allreduce size: µs (slowest rank) per path, elements wrong (all ranks), the path the tray uses
    (the low-latency one up to the ranks' ll_max_bytes where it was timed, else the faster of the others), and
    NCCL's faster formulation (`ar_nccl_best`: plain or on windows), which the ratios compare against."""
    rows = []
    ll_max_bytes = int(per_rank[0].get("ll_max_bytes", 0))
    for i, e0 in enumerate(per_rank[0]["sizes"]):
        entries = [r["sizes"][i] for r in per_rank]
        us = {k: max(e["us"][k] for e in entries) for k in e0["us"]}
        wrong = {k: sum(e["checks"]["wrong"][k] for e in entries) for k in e0["checks"]["wrong"]}
        timed = [k for k in (*LL_PATHS, *PEER_PATHS) if k in us] + [k for k in us if is_shape_key(k)]
        identical = all(e["checks"][f"{k}_identical_on_all_ranks"] for e in entries for k in timed)
        path = min(PEER_PATHS, key=lambda k: us[k])
        ll = best_ll(us)
        if ll is not None and e0["bytes"] <= ll_max_bytes:
            path = ll
        us["ar_peer"] = us[path]
        # NCCL's best formulation timed at this size: plain, or on symmetric windows (cuda, NCCL 2.27+)
        nccl = min(NCCL_PATHS, key=lambda k: us.get(k, math.inf))
        us["ar_nccl_best"] = us[nccl]
        # the tray's allreduce: the faster peer path, or NCCL where NCCL measured faster at this size
        tray_path = path if us[path] <= us[nccl] else nccl
        us["ar_tray"] = us[tray_path]
        rows.append({"bytes": e0["bytes"], "count": e0["count"], "us": us, "ar_peer_path": path,
                     "ar_tray_path": tray_path, "nccl_best_path": nccl,
                     "ratios": {"ar_peer_vs_nccl": us["ar_peer"] / us[nccl],
                                **({"ar_peer_vs_nccl_plain": us["ar_peer"] / us["ar_nccl"],
                                    "ar_nccl_win_vs_nccl": us["ar_nccl_win"] / us["ar_nccl"]}
                                   if "ar_nccl_win" in us else {}),
                                **({"ar_ll_vs_oneshot": us[LL_PATH] / us["ar_oneshot"]} if LL_PATH in us else {}),
                                **({"ar_ll3_vs_ll": us[LL3_PATH] / us[LL_PATH]}
                                   if LL3_PATH in us and LL_PATH in us else {})},
                     "checks": {"wrong": wrong, "peer_identical_on_all_ranks": identical,
                                "passed": identical and not any(wrong.values())}})
    return rows


def tp_within_nodes(per_rank: list[dict[str, Any]], per_node: int) -> bool:
    """Whether every rank reported and its TP group was the ranks of its node (global rank = node rank x
    `per_node` + local rank)."""
    ranks = sorted(r["rank"] for r in per_rank)
    if ranks != list(range(len(per_rank))) or len(ranks) % per_node:
        return False
    return all(r["tp_group"] == list(range(r["rank"] // per_node * per_node, (r["rank"] // per_node + 1) * per_node))
               for r in per_rank)


def best_ll(us: dict[str, float]) -> str | None:
    """The faster low-latency line format timed at a size (`ar_ll` on a tie; None: neither was timed)."""
    timed = [k for k in LL_PATHS if k in us]
    return min(timed, key=lambda k: us[k]) if timed else None


def is_shape_key(key: str) -> bool:
    """Whether `key` times the low-latency path at a launch shape other than the manifest's (`ar_ll[t512,l2]`,
    `ar_ll3[t128,l1]`)."""
    return key.startswith(tuple(p + "[" for p in LL_PATHS))


def ll_shapes_summary(sizes: list[dict[str, Any]], default_keys: dict[str, str]) -> list[dict[str, Any]]:
    """Per size where more than one low-latency shape was timed: the fastest key of either format (`ar_ll` and
    `ar_ll3` named by their manifest shapes, `default_keys`: program -> `ar_ll3[t128,l1]`), its µs, and its µs
    over `ar_ll`'s."""
    rows = []
    for r in sizes:
        u = r["us"]
        keys = [k for k in u if is_shape_key(k)]
        if LL_PATH not in u or not keys:
            continue
        best = min([k for k in LL_PATHS if k in u] + keys, key=lambda k: u[k])
        # `ar_ll` / `ar_ll3` ran the manifest's shape: name it as a shape key, `ar_ll3[t128,l1]`
        name = default_keys[best] if best in LL_PATHS else best
        rows.append({"bytes": r["bytes"], "best": name, "us": u[best], "vs_default": u[best] / u[LL_PATH]})
    return rows


def crossover(sizes: list[dict[str, Any]]) -> int | None:
    """The smallest size from which the two-shot is faster at every larger size (None: never)."""
    start = None
    for r in sizes:
        if r["us"]["ar_twoshot"] < r["us"]["ar_oneshot"]:
            start = r["bytes"] if start is None else start
        else:
            start = None
    return start


def ll_wins_up_to(sizes: list[dict[str, Any]]) -> int | None:
    """The largest size up to which the low-latency path (the faster line format) beat both other peer paths at
    every timed size (None: it lost at the smallest, or was not timed)."""
    best = None
    for r in sizes:
        u = r["us"]
        ll = best_ll(u)
        if ll is None or u[ll] > min(u[k] for k in PEER_PATHS):
            break
        best = r["bytes"]
    return best


def summarize_tokens(a: TpBenchArgs, per_rank: list[dict[str, Any]], one: dict[str, Any], work: Path) -> list[dict]:
    """Per token count: the layer through each path (slowest rank) vs one GPU, checked against it."""
    rows = []
    for i, e0 in enumerate(per_rank[0]["tokens"]):
        entries = [r["tokens"][i] for r in per_rank]
        t = e0["tokens"]
        us = {k: max(e["us"][k] for e in entries) for k in e0["us"]}
        # the path the tray uses: the low-latency one up to ll_max_bytes where timed, else the faster other one
        us["mlp_peer"] = min(us["mlp_one"], us["mlp_two"])
        if "mlp_ll" in us and t * (a.hidden or 0) * 2 <= int(per_rank[0].get("ll_max_bytes", 0)):
            us["mlp_peer"] = us["mlp_ll"]
        us["mlp_one_gpu"] = one["tokens"][i]["us"]["mlp_one"]
        ref = np.load(work / "one" / f"T{t}_peer.npy")
        checks: dict[str, Any] = {
            "mlp_peer_vs_one_gpu_rel_err": _rel(np.load(work / "tp" / f"T{t}_peer.npy"), ref),
            "mlp_nccl_vs_one_gpu_rel_err": _rel(np.load(work / "tp" / f"T{t}_nccl.npy"), ref),
            "peer_identical_on_all_ranks": all(e["checks"]["peer_identical_on_all_ranks"] for e in entries),
            "two_shot_equals_one_shot": all(e["checks"]["two_shot_equals_one_shot"] for e in entries),
            "ll_equals_one_shot": all(e["checks"].get("ll_equals_one_shot", True) for e in entries),
            "nan_rows": sum(e["checks"]["nan_rows"] for e in entries) + one["tokens"][i]["checks"]["nan_rows"],
        }
        checks["passed"] = bool(
            checks["peer_identical_on_all_ranks"] and checks["two_shot_equals_one_shot"]
            and checks["ll_equals_one_shot"] and checks["nan_rows"] == 0
            and all(not math.isnan(checks[k]) and checks[k] <= MLP_TOLERANCE
                    for k in ("mlp_peer_vs_one_gpu_rel_err", "mlp_nccl_vs_one_gpu_rel_err")))
        rows.append({"tokens": t, "bytes": t * (a.hidden or 0) * 2, "us": us,
                     "ratios": {"mlp_peer_vs_nccl": us["mlp_peer"] / us["mlp_nccl"],
                                "mlp_peer_vs_one_gpu": us["mlp_peer"] / us["mlp_one_gpu"]},
                     "checks": checks})
    return rows


def print_report(report: dict[str, Any]) -> None:
    base = baseline_name(report["backend"])
    one = "1 gpu" if report["backend"] == "cuda" else "1 rank"
    nn, tp = report.get("nnodes", 1), report.get("tp_size", report["nprocs"])
    where = "" if nn == 1 else (f" as a job of {nn} nodes of {tp} ranks, TP within each node (every node one TP "
                                f"group: {'ok' if report['tp_within_nodes'] else 'FAILED'})")
    print(f"tp: {report['nprocs']} ranks{where}, {report['backend']} backend; µs per call, captured, slowest rank; "
          f"baseline {base} ({'NCCL' if base == 'nccl' else 'the host backend’s shared-memory collectives'})")
    print(format_table(allreduce_rows(report)))
    print(f"  {'bytes':>9} {'low-lat':>9} {'ll dense':>9} {'one-shot':>9} {'two-shot':>9} {base:>9} "
          f"{base + ' win':>9} {'peer/best':>9} {'peer path':>10}  check")
    for r in report["sizes"]:
        u = r["us"]
        ll = " ".join(f"{u[k]:>9.2f}" if k in u else f"{'-':>9}" for k in LL_PATHS)
        win = f"{u['ar_nccl_win']:>9.2f}" if "ar_nccl_win" in u else f"{'-':>9}"
        print(f"  {r['bytes']:>9} {ll} {u['ar_oneshot']:>9.2f} {u['ar_twoshot']:>9.2f} {u['ar_nccl']:>9.2f} "
              f"{win} {r['ratios']['ar_peer_vs_nccl']:>9.2f} {r['ar_peer_path'][3:]:>10}  "
              f"{'ok' if r['checks']['passed'] else 'FAILED'}")
    print(f"  (peer/best: the peer path over the faster of {base} and {base} on symmetric windows, where timed)")
    wins = report["ll_wins_up_to_bytes"]
    timed = any(best_ll(r["us"]) for r in report["sizes"])
    print(f"  low-latency path: the tray uses it up to {report['ll_max_bytes']} B (ll_max_bytes); measured: "
          + ("not timed (--ll-sweep-bytes)" if not timed else
             f"it beats both other peer paths at every size up to {wins} B" if wins else
             "it does not beat the other peer paths at the smallest size"))
    print(f"  two-shot wins from {report['crossover_bytes']} B" if report["crossover_bytes"] else
          "  the two-shot does not win for good at any size")
    if "ll_shapes" in report:
        print(f"  low-latency launch shapes (ar_ll = {report['ll_shapes']['default']}, ar_ll3 = "
              f"{report['ll_shapes'].get('default_ll3', '?')}): the fastest per size")
        for r in report["ll_shapes"]["best_per_size"]:
            print(f"  {r['bytes']:>9} {r['best']:>22} {r['us']:>9.2f} µs  {r['vs_default']:.2f}x ar_ll")
    nccl_sizes = report["nccl_faster_bytes"]
    print(f"  {base} faster than the peer path the tray uses at: {nccl_sizes} B (the tray's allreduce calls it there)"
          if nccl_sizes else f"  a peer path is at least as fast as {base} at every size")
    print(f"tp layer: hidden {report['hidden']}, ffn {report['ffn']} ({report['ffn'] // tp} per rank)")
    print(f"  {'tokens':>7} {'low-lat':>10} {'one-shot':>10} {'two-shot':>10} {base:>10} {one:>10} {'peer/' + one:>11}"
          "  check")
    for r in report["tokens"]:
        u = r["us"]
        ll = f"{u['mlp_ll']:>10.1f}" if "mlp_ll" in u else f"{'-':>10}"
        print(f"  {r['tokens']:>7} {ll} {u['mlp_one']:>10.1f} {u['mlp_two']:>10.1f} {u['mlp_nccl']:>10.1f} "
              f"{u['mlp_one_gpu']:>10.1f} {r['ratios']['mlp_peer_vs_one_gpu']:>11.2f}  "
              f"{'ok' if r['checks']['passed'] else 'FAILED'}")
    print("PASSED" if report["passed"] else "FAILED")


def allreduce_rows(report: dict[str, Any]) -> list[Row]:
    """Every path per size as nccl-tests rows (bf16, busbw factor 2(n-1)/n over the n ranks of a TP group;
    #wrong: elements that failed the check after the timed replays, summed over the ranks)."""
    rows = []
    names = {LL_PATH: "allreduce low-latency", LL3_PATH: "allreduce low-latency dense",
             "ar_oneshot": "allreduce one-shot", "ar_twoshot": "allreduce two-shot",
             "ar_nccl": f"allreduce {baseline_name(report['backend'])}",
             "ar_nccl_win": f"allreduce {baseline_name(report['backend'])} windows"}
    for r in report["sizes"]:
        for path, name in names.items():
            if path not in r["us"]:
                continue
            rows.append(Row(name, r["bytes"], r["count"], "bf16", r["us"][path], r["checks"]["wrong"][path],
                            "allreduce", report.get("tp_size", report["nprocs"])))
    return rows


def plot(report: dict[str, Any], path: str) -> None:
    """Latency vs message size: the three allreduces, µs, log-log."""
    base = baseline_name(report["backend"])
    series: dict[str, tuple[list[float], list[float]]] = {}
    for key, label in ((LL_PATH, "allreduce low-latency"), (LL3_PATH, "allreduce low-latency dense"),
                       ("ar_oneshot", "allreduce one-shot"),
                       ("ar_twoshot", "allreduce two-shot"), ("ar_nccl", f"allreduce {base}"),
                       ("ar_nccl_win", f"allreduce {base} windows")):
        timed = [r for r in report["sizes"] if key in r["us"]]
        series[label] = ([r["bytes"] for r in timed], [r["us"][key] for r in timed])
    plot_lines(path, series, title=f"tp: {report['nprocs']} ranks, {report['backend']} backend",
               xlabel="message size (bytes)", ylabel="µs per call")


def ll_default_keys(result: dict[str, Any]) -> dict[str, str]:
    """The keys the manifest's own low-latency shapes would have in a sweep (`ar_ll` and `ar_ll3` time them)."""
    return {"ar_ll": LLShape(*result["ll_shape"], "ar_ll").key,
            "ar_ll3": LLShape(*result.get("ll3_shape", result["ll_shape"]), "ar_ll3").key}


def run_tp_bench(a: TpBenchArgs) -> int:
    """Check, time, print, write JSON. Returns the exit code: 0 passed, 1 failed."""
    a = a.resolved()
    validate(a)
    require_plot(a.plot_path)
    assert a.sizes is not None and a.tokens is not None
    work, remove_work = work_dir("tray-tp-" if a.keep else None)
    try:
        try:
            mib = buffers_nbytes(str(builtin_path(MANIFEST)), a.nprocs, launch_vars(a, a.tp_size),
                                 a.tp_size) / (1 << 20)
            where = "" if a.nnodes == 1 else f" as {a.nnodes} nodes of {a.tp_size} (TP within each node)"
            t0 = stage("tp", 1, 2, f"{a.nprocs} ranks{where}: {len(a.sizes)} sizes, {a.sizes[0]} .. {a.sizes[-1]} "
                                   f"B, then the layer at {len(a.tokens)} token counts, {a.repeats} repeats each, the "
                                   f"low-latency path up to {a.ll_sweep_bytes} B, "
                                   f"{mib:.1f} MiB of buffers per rank (a line per size from rank 0)")
            per_rank = _launch(a, a.nprocs, work, "tp")
            t1 = stage("tp", 2, 2, f"1 rank: the full layer for the reference ({time.monotonic() - t0:.1f} s so far)")
            one = _launch(a, 1, work, "one")[0]
            print(f"tp: done in {time.monotonic() - t0:.1f} s (reference {time.monotonic() - t1:.1f} s)", flush=True)
        except TrayFailed as exc:
            print(f"tp: {exc}", file=sys.stderr)
            return 1
        sizes = summarize_sizes(per_rank)
        tokens = summarize_tokens(a, per_rank, one, work)
    finally:
        if a.keep:
            print(f"tp: work files kept in {work}")
        remove_work()
    report = {
        "bench": "tp",
        "nprocs": a.nprocs,
        "nnodes": a.nnodes,
        "tp_size": a.tp_size,
        "tp_within_nodes": tp_within_nodes(per_rank, a.tp_size),
        "tp_groups": sorted({tuple(r["tp_group"]) for r in per_rank}),  # the TP groups the ranks ran in
        "backend": a.backend,
        "hidden": a.hidden,
        "ffn": a.ffn,
        "seed": a.seed,
        "repeats": a.repeats,
        "sizes": sizes,
        "crossover_bytes": crossover(sizes),
        "ll_max_bytes": int(per_rank[0]["ll_max_bytes"]),
        "ll_wins_up_to_bytes": ll_wins_up_to(sizes),
        **({"ll_shapes": {"default": ll_default_keys(per_rank[0])["ar_ll"],
                          "default_ll3": ll_default_keys(per_rank[0])["ar_ll3"],
                          "best_per_size": ll_shapes_summary(sizes, ll_default_keys(per_rank[0]))}}
           if a.ll_shapes else {}),
        "nccl_faster_bytes": [r["bytes"] for r in sizes if r["ar_tray_path"] in NCCL_PATHS],
        "tokens": tokens,
        "passed": all(s["checks"]["passed"] for s in sizes + tokens) and tp_within_nodes(per_rank, a.tp_size),
        "setup_s": max(r["setup_s"] for r in per_rank),
    }
    print_report(report)
    write_report(report, a.json_path, {"device": per_rank[0].get("device")})
    if a.plot_path:
        plot(report, a.plot_path)
        print(f"tp: plot in {a.plot_path}")
    return 0 if report["passed"] else 1
