"""`tray bench ep-moe`: the EP MoE layer over peer buffers vs NCCL all-to-all vs EP1, checked, then timed.

    tray bench ep-moe -n 4 [--tokens 128,4096] [--routing uniform,zipf] [--capacity 4|worst]
                      [--sms all,24] [--hidden 7168] [--experts 256] [--topk 8] [--expert-dim 2048]
                      [--backend cuda|host] [--json PATH] [--plot PATH] [--nnodes N] [--ll-phases]

The head (this module) draws a routing per (routing kind, token count) from a seed: the router's output,
topk_idx and topk_weights, which each rank uploads as device buffers. Everything after that happens on
the device inside the timed programs: the layout (counts, prefix sums, positions, capacity drops), the
dispatch (each token once per destination rank), the experts, the combine (one pre-reduced row per
(token, rank)) and the reduce. The head predicts what the layout must report (rows per expert, dropped
pairs) and which bytes cross NVLink, then launches two trays of manifests/ep_moe.json running
tray/programs/ep_moe/rank_program.py: N ranks (peer path, NCCL path, copy ceilings) and 1 rank (EP1, the same global
tokens and the same reduction groups). Checks: EP-N rows equal EP1 rows byte for byte (both paths, and
again after the timed graph replays), EP1 within bf16 tolerance of a float64 reference on sampled tokens
covering every expert, the layout's reports, no NaN. Exit 1 if a check fails.

What each figure (µs, captured graph replays, median, slowest rank) includes:
  dispatch       dispatch kernel (routing words to every rank, each token once per destination rank) +
                 peer barrier + layout (counts and positions per expert, and which received row each expert
                 slot holds) [+ fanout into the expert slab, cublas only]: everything between the router's
                 output and the experts
  dispatch_send  the dispatch kernel + barrier alone; layout, fanout: those kernels alone (fanout: cublas
                 only; the masked GEMMs read the received rows in place, there is nothing to copy)
  experts        gate/up GEMM, SiLU*up, down GEMM of every local expert (masked: one launch each over the
                 rows the layout counted, the gate/up GEMM gathering its rows from the receive buffer;
                 cublas: one cuBLAS GEMM per expert over all cap rows of the slab)
  combine        the combine kernel (a token's local expert outputs summed, one row per (token, rank) to its
                 origin) + peer barrier;  reduce: the origin's sum over ranks
  layer          all of the above in one graph
  dispatch_ll, combine_ll, layer_ll   the low-latency mode: dispatch + layout (+ fanout) in one kernel, and
                 combine + reduce in one kernel, synchronised by device flags (no peer barrier, no kernel
                 boundary between the steps); layer_ll = dispatch_ll + experts + combine_ll. Its outputs are
                 checked against EP1 byte for byte like the others (EP1 runs the mode too)
With --ll-phases (cuda, one node; after each run's normal timing and checks, at the first SM budget) the
EP-N ranks also time the low-latency kernels' diagnosis builds (dispatch_ll_phases, combine_ll_phases: the
same bytes, each block stamping its phase boundaries), captured as the production kernels are, and report
per rank under runs[].ll_phases: per phase the span since the first block's entry (globaltimer) and the
per-block durations (SM cycles over the SM clock measured in the same run), the diagnosis build's µs beside
the production figure (what the stamps cost), and any record that failed its checks (then exit 1). See
tray/programs/ep_moe/ll_phases.py for which clock to trust for what.
The NCCL path runs the same kernels with local send buffers and two all-to-alls (routing words, then rows:
a fixed upper bound of tokens rows per (source, destination) pair, so no count reaches the host), and one
all-to-all back. Bytes: logical = tokens x topk rows per rank each way; NVLink = the (token, other rank)
rows actually sent (+ routing words on dispatch); the ceiling is every rank writing tokens rows to each
other rank at once (copy engines and a kernel; the faster counts).

With --nnodes N (N >= 2) the EP-N tray is a job of N nodes on this machine (tray/bench/nodes.py: one
`tray launch --nnodes N` per node, -n / N ranks each, on cuda its share of the GPUs and its own
NCCL_HOSTID, so NCCL crosses between the nodes over its network transport). Peer mappings exist only
within a node: the peer path's dispatch and combine kernels write this node's members through the peer
tables and the other nodes' rows into local staging blocks, which one all-to-all across nodes carries
(NCCL); the NCCL path runs beside it. Both are checked against EP1 (one tray, as always) byte for byte;
the low-latency mode and the ceiling need peer mappings to every member and are not run. The report
says `"nnodes"` and `"cross_node_path"`.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tray.bench import TrayFailed, plot_lines, require_plot, run_rank_program, stage, write_report
from tray.errors import TrayError, UsageError
from tray.launch.jobdir import work_dir
from tray.manifest.builtin import builtin_path
from tray.text import is_digits

MANIFEST = "ep_moe"  # built-in (package data), see tray.manifest.builtin
# NOTE: bf16 operands and four bf16 roundings on the way (h13, act, expert output, per-rank partial):
# a few 1e-3 expected.
REF_TOLERANCE = 2e-2
PEER_PHASES = ("dispatch", "dispatch_send", "layout", "fanout", "experts", "combine", "reduce", "layer",
               "dispatch_ll", "combine_ll", "layer_ll")
# phases only some expert paths have: the fanout exists for the cuBLAS GEMMs' dense slab alone
PHASE_GEMMS = {"fanout": ("cublas",)}
# the expert GEMMs: masked (mma.sync, every size), wgmma (Hopper warpgroup MMA, sm_90a only: large batches),
# cublas (a cuBLAS GEMM per expert over all cap rows); auto: each rank picks wgmma on compute capability 9.0, else
# masked (resolve_gemm), and the report names what ran
GEMMS = ("auto", "masked", "wgmma", "cublas")
# the paths whose outputs are compared with EP1 byte for byte ("ll": the peer path's low-latency mode)
PATHS = ("peer", "ll", "nccl")
NCCL_PHASES = {
    "dispatch": "dispatch_nccl",
    "experts": "experts",
    "combine": "combine_nccl",
    "reduce": "reduce",
    "layer": "layer_nccl",
}
BLAS_THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
# NOTE: "eager" is the default because captured replays of the NCCL path hung on 2x H200 (rank 0 silent
# after the peer figures) while eager runs of the same programs completed; "captured" stays selectable.
NCCL_TIMINGS = ("eager", "captured")
# --dispatch: bf16 (every run: the baseline) and fp8 (e4m3 rows + a float32 scale per 128 values, dequantized to
# bf16 on the receiver; its figures dispatch_fp8 and layer_fp8, its outputs checked against EP1's FP8 path)
DISPATCHES = ("bf16", "fp8")
FP8_BLOCK = 128  # NOTE: values per float32 scale (ep_moe.cu's FP8_BLOCK)
FP8_PHASES = ("dispatch_fp8", "layer_fp8")
# NOTE: e4m3 keeps 3 mantissa bits (2^-4 relative half step): with per-128 scales the layer's output moves by
# a few percent of its norm; beyond this the quantization is broken, not merely coarse.
FP8_TOLERANCE = 0.1
NCCL_CTA_ENV = ("NCCL_MAX_CTAS", "NCCL_MIN_CTAS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS")


@dataclass(frozen=True)
class EpBenchArgs:
    nprocs: int
    backend: str
    tokens: tuple[int, ...] = (128, 4096)
    hidden: int = 7168
    experts: int = 256
    topk: int = 8
    expert_dim: int = 2048
    routings: tuple[str, ...] = ("uniform", "zipf")
    capacity: str = "4"
    gemm: str = "auto"
    budgets: tuple[str, ...] = ("all", "24")
    seed: int = 0
    repeats: int = 10
    warmup: int = 2
    ref_tokens: int = 8
    json_path: str | None = None
    plot_path: str | None = None
    log_dir: str | None = None
    keep: bool = False
    nccl_timing: str = "captured"
    nnodes: int = 1
    dispatch: tuple[str, ...] = ("bf16",)
    ll_phases: bool = False


# what carries the rows between nodes in a job of several (README.md, "Several nodes": peer tables stay within a node)
CROSS_NODE_PATH = "peer path within a node, its rows for other nodes staged and carried by an NCCL all-to-all"


def paths_of(a: EpBenchArgs) -> tuple[str, ...]:
    """The EP-N paths checked against EP1: all on one node; across nodes the peer path (staged between
    nodes) and the NCCL path (the low-latency mode waits on every member's flags: within a node only)."""
    return PATHS if a.nnodes == 1 else ("peer", "nccl")


def validate(a: EpBenchArgs) -> None:
    """UsageError for shapes the kernels or the comparison cannot take."""
    from tray.bench.nodes import check_nnodes
    from tray.programs.ep_moe.plan import capacity, parse_routing
    from tray.programs.ep_moe.twins import LAYOUT_MAX_LOCAL

    if a.nprocs < 2:
        raise UsageError(f"ep-moe compares N ranks with EP1: -n must be at least 2, got {a.nprocs}")
    if a.experts < 1 or a.experts % a.nprocs:
        raise UsageError(f"--experts {a.experts} must be at least 1 and divide over {a.nprocs} ranks")
    if a.hidden < 8 or a.expert_dim < 8:
        raise UsageError(f"--hidden ({a.hidden}) and --expert-dim ({a.expert_dim}) must be at least 8")
    if a.ref_tokens < 0:
        raise UsageError(f"--ref-tokens is how many tokens of each run are checked against float64: 0 or more, got "
                         f"{a.ref_tokens}")
    check_nnodes(a.nnodes, a.nprocs)
    if a.nprocs > 64:
        raise UsageError(f"the reduce keeps one bit per rank: at most 64 ranks, got {a.nprocs}")
    if a.experts > LAYOUT_MAX_LOCAL:
        # NOTE: EP1 holds every expert, and the layout keeps one shared-memory counter per local expert
        raise UsageError(f"the device layout counts at most {LAYOUT_MAX_LOCAL} experts per rank (EP1 holds them all): "
                         f"--experts must be at most {LAYOUT_MAX_LOCAL}, got {a.experts}")
    if a.hidden % 8 or a.expert_dim % 8:
        raise UsageError(
            f"--hidden ({a.hidden}) and --expert-dim ({a.expert_dim}) must be multiples of 8 "
            "(rows move as 16-byte vectors)"
        )
    if not 1 <= a.topk <= a.experts:
        raise UsageError(f"--topk must be in 1..{a.experts}, got {a.topk}")
    if not a.tokens or min(a.tokens) < 1:
        raise UsageError(f"--tokens needs positive counts, got {a.tokens}")
    if a.nccl_timing not in NCCL_TIMINGS:
        raise UsageError(f"--nccl-timing is 'eager' or 'captured', got {a.nccl_timing!r}")
    if a.gemm not in GEMMS:
        raise UsageError(f"--gemm is {', '.join(repr(g) for g in GEMMS)}, got {a.gemm!r}")
    for r in a.routings:
        parse_routing(r)
    capacity(a.capacity, a.nprocs, 1, a.topk, a.experts)
    if a.nnodes > 1 and a.plot_path:
        raise UsageError("--plot draws the one-node figures (the low-latency mode among them); leave out --plot or "
                         "--nnodes")
    if "bf16" not in a.dispatch or not set(a.dispatch) <= set(DISPATCHES):
        raise UsageError(f"--dispatch takes bf16 (the baseline every run checks) and optionally fp8, e.g. bf16,fp8; "
                         f"got {','.join(a.dispatch)}")
    if "fp8" in a.dispatch and (a.hidden % FP8_BLOCK or a.nnodes > 1):
        raise UsageError(f"--dispatch fp8 needs --hidden a multiple of {FP8_BLOCK} (one scale per {FP8_BLOCK} values; "
                         f"got {a.hidden}) and one node (got --nnodes {a.nnodes})")
    for b in a.budgets:
        if b != "all" and not (is_digits(b) and int(b) >= 1):
            raise UsageError(f"--sms takes 'all' or positive SM counts, got {b!r}")
    if a.ll_phases and (a.backend != "cuda" or a.nnodes > 1 or a.gemm == "cublas"):
        raise UsageError(
            "--ll-phases times the low-latency kernels' diagnosis build from the GPU's clocks: it needs --backend "
            "cuda (the host twins have no clock), one node (the low-latency mode runs within a node) and the "
            f"dispatch without fanout (--gemm masked, wgmma or auto); got --backend {a.backend}, --nnodes {a.nnodes}, "
            f"--gemm {a.gemm}")


def ran_gemm(asked: str, per_rank: list[dict[str, Any]], ep1: dict[str, Any]) -> str:
    """The expert GEMMs every rank of both trays ran (`asked` resolved on the device: 'auto' -> wgmma or masked).
    Raises TrayError when they differ (EP-N == EP1 byte for byte needs the same kernels)."""
    ran = {r.get("gemm", asked) for r in [*per_rank, ep1]}
    if len(ran) != 1:
        raise TrayError(f"--gemm {asked}: the ranks ran different expert GEMMs ({', '.join(sorted(ran))}); the "
                        "EP-N and EP1 trays must run one kind on the same devices (name it: --gemm masked or wgmma)")
    return ran.pop()


def peer_phases(gemm: str, dispatch: tuple[str, ...] = ("bf16",)) -> tuple[str, ...]:
    """The peer path's (and EP1's) timed phases with expert GEMMs `gemm` (one of GEMMS), and the FP8
    dispatch's when `dispatch` names it."""
    fp8 = FP8_PHASES if "fp8" in dispatch else ()
    return tuple(p for p in PEER_PHASES if gemm in PHASE_GEMMS.get(p, (gemm,))) + fp8


def label_of(routing: str, tokens: int) -> str:
    return f"{routing.replace(':', '')}_T{tokens}"


def prepare(a: EpBenchArgs, work: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Routings and per-rank inputs for every (routing, token count): (EP-N runs, EP1 runs, facts per
    label: cap, predicted drops and NVLink rows)."""
    from tray.programs.ep_moe.plan import capacity, expected, parse_routing, random_routing, reference_tokens

    G = a.nprocs
    runs_n, runs_1, facts = [], [], {}
    for ri, kind in enumerate(a.routings):
        for ti, T in enumerate(a.tokens):
            label = label_of(kind, T)
            routing = random_routing(
                G * T, a.experts, a.topk, seed=(a.seed * 1_000_003 + T) * 31 + ri, skew=parse_routing(kind)
            )
            cap = capacity(a.capacity, G, T, a.topk, a.experts)
            exp_n = expected(routing, G, cap)
            d = work / label
            d.mkdir()
            L = a.experts // G
            for r in range(G):
                rows = slice(r * T, (r + 1) * T)
                np.savez(
                    d / f"r{r}.npz",
                    topk_idx=routing.experts[rows],
                    topk_w=routing.weights[rows],
                    expert_rows=exp_n.expert_rows[r * L : (r + 1) * L],
                    dropped=exp_n.dropped[r],
                )
            np.savez(
                d / "ep1.npz",
                topk_idx=routing.experts,
                topk_w=routing.weights,
                expert_rows=exp_n.expert_rows,
                dropped=exp_n.dropped.sum(),
                kept=exp_n.kept,
            )
            # NOTE: covering every expert reads every expert's weights (88 MB each at the cuda shape) back to the
            # host and runs it in float64 (~70 ms of a core each, on several threads: ~3 s for 256 experts):
            # once per routing, in its first token count; the other runs check ref_tokens evenly spaced
            # tokens (at most ref_tokens * topk experts)
            ref = reference_tokens(routing, exp_n.kept, a.ref_tokens, cover=ti == 0)
            runs_n.append({"label": label, "tokens": T, "cap": cap, "inputs": str(d)})
            runs_1.append({"label": label, "tokens": G * T, "cap": cap, "inputs": str(d), "ref_tokens": ref})
            facts[label] = {
                "routing": kind,
                "tokens_per_rank": T,
                "cap": cap,
                "max_rows_per_expert": int(np.bincount(routing.experts.ravel(), minlength=a.experts).max()),
                "dropped_pairs": int(exp_n.dropped.sum()),
                "pairs": G * T * a.topk,
                "nvlink_rows_per_rank": exp_n.dispatch_rows.tolist(),
                "local_rows_per_rank": exp_n.local_rows.tolist(),
            }
    return runs_n, runs_1, facts


def launch_vars(a: EpBenchArgs, max_tokens: int, max_cap: int) -> dict[str, int]:
    """Vars a tray is launched with: buffers are sized by max_tokens / max_cap; tokens and cap start at
    their maxima so every program resolves at launch; EP1 keeps EP-N's reduction groups."""
    return {
        "hidden": a.hidden,
        "experts": a.experts,
        "topk": a.topk,
        "ffn": a.expert_dim,
        "max_tokens": max_tokens,
        "max_cap": max_cap,
        "tokens": max_tokens,
        "cap": max_cap,
        "groups": a.nprocs,
    }


def ll_phase_vars(a: EpBenchArgs) -> dict[str, int]:
    """The EP-N tray's vars that size ll_phases for --ll-phases ({} without it: the manifest's one-record buffer)."""
    from tray.programs.ep_moe.ll_phases import BLOCK_SLOTS, LAUNCH_SLOTS

    return {"ll_phase_blocks": BLOCK_SLOTS, "ll_phase_launches": LAUNCH_SLOTS} if a.ll_phases else {}


def ll_phases_of(per_rank: list[dict[str, Any]], i: int) -> dict[str, Any] | None:
    """Run i's low-latency phase records of every rank ({"per_rank": [...], "ok": ...}), None when not taken."""
    entries = [r["runs"][i].get("ll_phases") for r in per_rank]
    if not any(entries):
        return None
    ok = all(e is not None and e["ok"] for e in entries)
    return {"per_rank": entries, "ok": ok}


def launch(
    a: EpBenchArgs, nprocs: int, runs: list[dict[str, Any]], vars_: dict[str, int], work: Path, name: str
) -> list[dict[str, Any]]:
    """One tray of the rank program; returns every rank's result. Raises TrayFailed with the root cause."""
    cfg = {
        "hidden": a.hidden,
        "experts": a.experts,
        "topk": a.topk,
        "ffn": a.expert_dim,
        "groups": a.nprocs,
        "gemm": a.gemm,
        "seed": a.seed,
        "backend": a.backend,
        # NOTE: across nodes one budget (the whole GPU): the figure there is the exchange between nodes
        "budgets": list(a.budgets) if nprocs > 1 and a.nnodes == 1 else ["all"],
        "repeats": a.repeats,
        "warmup": a.warmup,
        "target_s": 2e-3 if a.backend == "cuda" else 0.0,
        "nccl_timing": a.nccl_timing,
        "dispatch": list(a.dispatch),
        "ll_phases": a.ll_phases and nprocs > 1,
        "runs": runs,
    }
    # NOTE: a host rank is one CPU worker: with the BLAS's default of a thread per core, N ranks spin
    # N x cores threads against each other (measured 7x slower expert GEMMs at 2 ranks on 2 cores). On
    # cuda the only BLAS work is EP1's float64 reference, which runs experts on its own threads
    # (tray/programs/ep_moe/reference.py): a threaded BLAS under each would oversubscribe the cores.
    env = {k: os.environ.get(k, "1") for k in BLAS_THREAD_ENV}
    if nprocs > 1 and a.nnodes > 1:
        from tray.bench.nodes import NodeJob, run_rank_program_nodes

        job = NodeJob(name=name, module="tray.programs.ep_moe.rank_program", nnodes=a.nnodes, nprocs=nprocs,
                      backend=a.backend, manifest=str(builtin_path(MANIFEST)), vars=vars_, log_dir=a.log_dir, env=env)
        return run_rank_program_nodes(job, cfg, work)
    return run_rank_program(
        name,
        "tray.programs.ep_moe.rank_program",
        cfg,
        work,
        nprocs=nprocs,
        backend=a.backend,
        manifest=str(builtin_path(MANIFEST)),
        vars=vars_,
        log_dir=a.log_dir,
        env=env,
    )


def _slowest(per_rank: list[dict[str, Any]], index: int, budget: str, key: str) -> float:
    vals = [r["runs"][index]["us"].get(budget, {}).get(key, float("nan")) for r in per_rank]
    vals = [v for v in vals if not math.isnan(v)]  # NaN: a figure a rank could not take
    return max(vals) if vals else float("nan")


def _gbps(nbytes: float, us: float) -> float:
    return nbytes / us / 1e3 if us > 0 and not math.isnan(us) else float("nan")


def summarize_checks(
    a: EpBenchArgs, per_rank: list[dict[str, Any]], e1: dict[str, Any], i: int, label: str, work: Path
) -> dict[str, Any]:
    G = a.nprocs
    paths = paths_of(a)
    ref_out = np.load(work / "ep1" / f"{label}_ep1.npy")
    rank_checks = [r["runs"][i]["checks"] for r in per_rank]
    c1 = e1["checks"]
    checks: dict[str, Any] = {"rows": int(ref_out.shape[0])}
    for path in paths:
        got = np.concatenate([np.load(work / "epn" / f"{label}_{path}_r{r}.npy") for r in range(G)])
        checks[f"{path}_rows_differ_from_ep1"] = int((got != ref_out).any(axis=1).sum())
    ep1_ll = np.load(work / "ep1" / f"{label}_ep1_ll.npy")
    checks["ep1_ll_rows_differ_from_ep1"] = int((ep1_ll != ref_out).any(axis=1).sum())
    ref = e1.get("reference", {})
    checks["ep1_vs_float64_rel_err"] = ref.get("rel_err")
    checks["ep1_ref_tokens"] = ref.get("ref_tokens")
    checks["ep1_ref_experts_covered"] = ref.get("experts_covered")
    checks["err_words"] = [c[f"{p}_err_words"] for c in rank_checks for p in paths] + [
        c1[f"{p}_err_words"] for p in ("peer", "ll")]
    checks["layout_reports_ok"] = all(
        c[f"{p}_err_ok"] and c[f"{p}_expert_rows_ok"] for c in rank_checks for p in paths
    ) and all(c1[f"{p}_err_ok"] and c1[f"{p}_expert_rows_ok"] for p in ("peer", "ll"))
    checks["nan_rows"] = sum(c[f"{p}_nan_rows"] for c in rank_checks for p in paths) + c1["peer_nan_rows"] + c1[
        "ll_nan_rows"]
    checks["after_replay_equal"] = all(c[f"{p}_after_replay_equal"] for c in rank_checks for p in paths) and all(
        c1[f"{p}_after_replay_equal"] for p in ("peer", "ll"))
    checks["ll_equals_peer"] = all(c.get("ll_equals_peer", True) for c in rank_checks) and bool(c1["ll_equals_peer"])
    for p in paths:
        hows = {c[f"{p}_after_replay_how"] for c in rank_checks if f"{p}_after_replay_how" in c}
        if hows:  # NOTE: a path with NCCL timed eagerly is checked by an eager rerun, not a replay: say so
            checks[f"{p}_after_replay_how"] = ", ".join(sorted(hows))
    rel = checks["ep1_vs_float64_rel_err"]
    fp8_ok = True
    if "fp8" in a.dispatch:
        fp8_ok = fp8_checks(checks, per_rank, e1, i, label, work, ref_out)
    checks["passed"] = bool(
        fp8_ok
        and all(checks[f"{p}_rows_differ_from_ep1"] == 0 for p in paths)
        and checks["ep1_ll_rows_differ_from_ep1"] == 0
        and checks["ll_equals_peer"]
        and rel is not None
        and not math.isnan(rel)
        and rel <= REF_TOLERANCE
        and checks["layout_reports_ok"]
        and checks["nan_rows"] == 0
        and checks["after_replay_equal"]
        and all(c.get("nccl_equals_peer", True) for c in rank_checks)
    )
    return checks


def fp8_checks(checks: dict[str, Any], per_rank: list[dict[str, Any]], e1: dict[str, Any], i: int, label: str,
               work: Path, ref_out: np.ndarray) -> bool:
    """The FP8 dispatch's checks, into `checks`: EP-N's FP8 outputs against EP1's FP8 outputs byte for byte (EP1
    quantizes the same rows the same way), layout reports, NaN rows, the check after a replay, and its
    accuracy: the relative error (Frobenius norm over all rows) of EP1's FP8 output against EP1's bf16 output
    `ref_out` (u16 [rows, hidden]), and on the sampled tokens against float64. Returns whether they pass."""
    from tray.dtypes import bf16_bits_to_f32

    G = len(per_rank)
    ep1_fp8 = np.load(work / "ep1" / f"{label}_ep1_fp8.npy")
    got = np.concatenate([np.load(work / "epn" / f"{label}_fp8_r{r}.npy") for r in range(G)])
    checks["fp8_rows_differ_from_ep1_fp8"] = int((got != ep1_fp8).any(axis=1).sum())
    rank_checks = [r["runs"][i]["checks"] for r in per_rank] + [e1["checks"]]
    layout_ok = all(c["fp8_err_ok"] and c["fp8_expert_rows_ok"] for c in rank_checks)
    nan_rows = sum(c["fp8_nan_rows"] for c in rank_checks)
    replay_ok = all(c["fp8_after_replay_equal"] for c in rank_checks)
    q, b = bf16_bits_to_f32(ep1_fp8).astype(np.float64), bf16_bits_to_f32(ref_out).astype(np.float64)
    rel_bf16 = float(np.linalg.norm(q - b) / max(np.linalg.norm(b), 1e-30)) if np.isfinite(q).all() else float("nan")
    rel_f64 = e1.get("reference", {}).get("rel_err_fp8")
    checks["fp8_vs_bf16_rel_err"] = rel_bf16
    checks["fp8_vs_float64_rel_err"] = rel_f64
    checks["fp8_tolerance"] = FP8_TOLERANCE
    checks["fp8_layout_reports_ok"] = layout_ok
    checks["fp8_nan_rows"] = nan_rows
    checks["fp8_after_replay_equal"] = replay_ok
    return bool(
        checks["fp8_rows_differ_from_ep1_fp8"] == 0
        and layout_ok
        and nan_rows == 0
        and replay_ok
        and 0 < rel_bf16 <= FP8_TOLERANCE
        and rel_f64 is not None
        and 0 < rel_f64 <= FP8_TOLERANCE
    )


def summarize(
    a: EpBenchArgs, per_rank: list[dict[str, Any]], ep1: dict[str, Any], facts: dict[str, Any], work: Path
) -> list[dict[str, Any]]:
    G, K, H = a.nprocs, a.topk, a.hidden
    budgets = list(per_rank[0]["runs"][0]["us"])  # "sm<N>" in --sms order
    runs = []
    for i, r0 in enumerate(per_rank[0]["runs"]):
        label = r0["label"]
        f = facts[label]
        T = f["tokens_per_rank"]
        e1 = ep1["runs"][i]
        us: dict[str, Any] = {}
        phases = peer_phases(a.gemm, a.dispatch)
        for j, b in enumerate(budgets):
            key = "peer" if j == 0 else f"peer_{b}"
            us[key] = {p: _slowest(per_rank, i, b, p) for p in phases}
        us["nccl"] = {p: _slowest(per_rank, i, budgets[0], k) for p, k in NCCL_PHASES.items()}
        e1_us = e1["us"][next(iter(e1["us"]))]
        us["ep1"] = {p: e1_us[p] for p in phases}
        us["ceiling_kernel"] = _slowest(per_rank, i, budgets[0], "ceiling")
        us["ceiling_ce"] = _slowest(per_rank, i, budgets[0], "ceiling_ce")
        row = 2 * H
        logical = T * K * row  # every (token, expert) row a rank sends (and gets back)
        physical = float(np.mean(f["nvlink_rows_per_rank"])) * row + (G - 1) * T * K * 4  # + routing words
        ceiling_bytes = (G - 1) * T * row
        ceiling_us = float(np.nanmin([us["ceiling_kernel"], us["ceiling_ce"]]))
        gbps: dict[str, Any] = {
            "logical_bytes_per_rank": logical,
            "nvlink_bytes_per_rank": physical,
            "ceiling_bytes_per_rank": ceiling_bytes,
            "ceiling": _gbps(ceiling_bytes, ceiling_us),
        }
        for key in [k for k in us if k.startswith("peer")] + ["nccl"]:
            for phase in ("dispatch", "combine", "dispatch_ll", "combine_ll"):
                if phase not in us[key]:
                    continue  # NOTE: the low-latency mode is a peer-path figure
                t = us[key][phase]
                gbps[f"{key}_{phase}_logical"] = _gbps(logical, t)
                nv = physical if phase.startswith("dispatch") else physical - (G - 1) * T * K * 4
                gbps[f"{key}_{phase}_nvlink"] = _gbps(nv, t)
        if "fp8" in a.dispatch:  # e4m3 bytes and a float32 scale per 128 values per row sent, + routing words
            row8 = H + H // FP8_BLOCK * 4
            gbps["nvlink_bytes_per_rank_fp8"] = float(np.mean(f["nvlink_rows_per_rank"])) * row8 + (G - 1) * T * K * 4
            for key in [k for k in us if k.startswith("peer")]:
                gbps[f"{key}_dispatch_fp8_nvlink"] = _gbps(gbps["nvlink_bytes_per_rank_fp8"], us[key]["dispatch_fp8"])
        gbps["peer_dispatch_send_nvlink_vs_ceiling"] = _gbps(physical, us["peer"]["dispatch_send"]) / gbps["ceiling"]
        dc = {k: us[k]["dispatch"] + us[k]["combine"] for k in us if k.startswith("peer") or k == "nccl"}
        ratios = {f"{k}_dispatch_combine_vs_nccl": v / dc["nccl"] for k, v in dc.items() if k != "nccl"}
        for k in [k for k in us if k.startswith("peer")]:
            ratios[f"{k}_ll_dispatch_combine_vs_nccl"] = (us[k]["dispatch_ll"] + us[k]["combine_ll"]) / dc["nccl"]
        ratios["peer_layer_vs_nccl_layer"] = us["peer"]["layer"] / us["nccl"]["layer"]
        ratios["peer_layer_ll_vs_nccl_layer"] = us["peer"]["layer_ll"] / us["nccl"]["layer"]
        ratios["epn_layer_vs_ep1_layer"] = us["peer"]["layer"] / us["ep1"]["layer"]
        ratios["layout_share_of_dispatch"] = us["peer"]["layout"] / us["peer"]["dispatch"]
        sms = {("peer" if j == 0 else f"peer_{b}"): int(b[2:]) for j, b in enumerate(budgets)}
        sms["nccl"] = {k: os.environ[k] for k in NCCL_CTA_ENV if k in os.environ} or "NCCL's own choice (env unset)"
        timing = dict(r0.get("timing", {}))
        if "eager_dispatch" in r0["us"][budgets[0]]:
            us["peer_eager"] = {p: _slowest(per_rank, i, budgets[0], f"eager_{p}") for p in ("dispatch", "combine",
                                                                                             "layer")}
            ratios["peer_eager_dispatch_combine_vs_nccl"] = (
                (us["peer_eager"]["dispatch"] + us["peer_eager"]["combine"]) / dc["nccl"])
            ratios["peer_eager_layer_vs_nccl_layer"] = us["peer_eager"]["layer"] / us["nccl"]["layer"]
        ll_entry = ll_phases_of(per_rank, i)
        runs.append(
            {
                "label": label,
                **f,
                "timing": {
                    "peer": "captured",
                    "peer_eager": "eager",
                    "nccl": {p: timing.get(k, "captured") for p, k in NCCL_PHASES.items()},
                    "ep1": "captured",
                },
                "global_tokens": G * T,
                "checks": summarize_checks(a, per_rank, e1, i, label, work),
                "us": us,
                "gbps": gbps,
                "ratios": ratios,
                "sms": sms,
            }
        )
        if ll_entry is not None:
            runs[-1]["ll_phases"] = ll_entry
    return runs


def summarize_nodes(
    a: EpBenchArgs, per_rank: list[dict[str, Any]], ep1: dict[str, Any], facts: dict[str, Any], work: Path
) -> list[dict[str, Any]]:
    """The runs of a job of several nodes: the peer path (staged between nodes) and the NCCL path against
    EP1, checks and µs (slowest rank), and the ratios of the layers."""
    budget = list(per_rank[0]["runs"][0]["us"])[0]
    phases = peer_phases(a.gemm)
    runs = []
    for i, r0 in enumerate(per_rank[0]["runs"]):
        label = r0["label"]
        e1 = ep1["runs"][i]
        e1_us = e1["us"][next(iter(e1["us"]))]
        us = {"peer": {p: _slowest(per_rank, i, budget, p) for p in phases if not p.endswith("_ll")},
              "nccl": {p: _slowest(per_rank, i, budget, k) for p, k in NCCL_PHASES.items()},
              "ep1": {p: e1_us[p] for p in phases}}
        timing = dict(r0.get("timing", {}))
        dc = {k: us[k]["dispatch"] + us[k]["combine"] for k in ("peer", "nccl")}
        runs.append({
            "label": label,
            **facts[label],
            "timing": {"peer": {p: timing.get(p, "captured") for p in us["peer"]},
                       "nccl": {p: timing.get(k, "captured") for p, k in NCCL_PHASES.items()}, "ep1": "captured"},
            "global_tokens": a.nprocs * facts[label]["tokens_per_rank"],
            "checks": summarize_checks(a, per_rank, e1, i, label, work),
            "us": us,
            "ratios": {"peer_dispatch_combine_vs_nccl": dc["peer"] / dc["nccl"],
                       "peer_layer_vs_nccl_layer": us["peer"]["layer"] / us["nccl"]["layer"],
                       "epn_layer_vs_ep1_layer": us["peer"]["layer"] / us["ep1"]["layer"]},
        })
    return runs


def print_report_nodes(report: dict[str, Any]) -> None:
    """The short table of a job of several nodes (peer path staged between nodes, NCCL path, EP1)."""
    s, G, nn = report["shape"], report["nprocs"], report["nnodes"]
    print(f"ep-moe: {G} ranks on {nn} nodes ({G // nn} per node), {report['backend']} backend; hidden {s['hidden']}, "
          f"{s['experts']} experts, top-{s['topk']}, expert dim {s['ffn']}; between nodes: "
          f"{report['cross_node_path']}; µs, slowest rank (programs that run NCCL timed {report['nccl_timing']}, the "
          "rest captured)")
    head = ("dispatch", "experts", "combine", "reduce", "layer")
    print(f"  {'run':<16} {'path':<12} " + " ".join(f"{h:>9}" for h in head))
    for run in report["runs"]:
        for path, u in run["us"].items():
            name = path if path == "ep1" else f"EP{G} {path}"
            print(f"  {run['label']:<16} {name:<12} " + " ".join(f"{u.get(h, float('nan')):>9.1f}" for h in head))
        c = run["checks"]
        rel = c["ep1_vs_float64_rel_err"]
        r = run["ratios"]
        print(f"  {'':<16} peer d+c / NCCL d+c {r['peer_dispatch_combine_vs_nccl']:.2f}; peer layer / NCCL layer "
              f"{r['peer_layer_vs_nccl_layer']:.2f}; EP{G} layer / EP1 layer {r['epn_layer_vs_ep1_layer']:.2f}")
        print(f"  {'':<16} rows differing from EP1: peer {c['peer_rows_differ_from_ep1']}/{c['rows']}, NCCL "
              f"{c['nccl_rows_differ_from_ep1']}/{c['rows']}; after replays equal {c['after_replay_equal']}; layout "
              f"reports {c['layout_reports_ok']}; EP1 vs float64 {'not checked' if rel is None else f'{rel:.2e}'}; "
              f"{'PASSED' if c['passed'] else 'FAILED'}")
    print("PASSED" if report["passed"] else "FAILED")


def print_report(report: dict[str, Any]) -> None:
    s = report["shape"]
    G = report["nprocs"]
    print(
        f"ep-moe: {G} ranks, {report['backend']} backend; hidden {s['hidden']}, {s['experts']} experts "
        f"({s['experts'] // G} per rank), top-{s['topk']}, expert dim {s['ffn']}, capacity {report['capacity']}, "
        f"expert GEMMs {report['gemm']}; "
        "µs, slowest rank, median of captured replays"
        + ("" if report.get("nccl_timing") != "eager" else
           "; the NCCL path's dispatch/combine/layer and the peer_eager rows are EAGER launches from Python "
           "(host launch cost included): compare them with each other")
    )
    head = ("dispatch", "layout", "experts", "combine", "reduce", "layer")
    print(f"  {'run':<16} {'path':<12} " + " ".join(f"{h:>9}" for h in head))
    for run in report["runs"]:
        for path, u in run["us"].items():
            if not isinstance(u, dict):
                continue
            label = f"EP{G} {path}" if path.startswith("peer") else path
            print(f"  {run['label']:<16} {label:<12} " + " ".join(f"{u.get(h, float('nan')):>9.1f}" for h in head))
        g, r, c = run["gbps"], run["ratios"], run["checks"]
        print(
            f"  {'':<16} cap {run['cap']} (largest expert {run['max_rows_per_expert']} rows; dropped "
            f"{run['dropped_pairs']}/{run['pairs']} pairs); NVLink GB/s dispatch {g['peer_dispatch_nvlink']:.1f}, "
            f"combine {g['peer_combine_nvlink']:.1f} (logical {g['peer_dispatch_logical']:.1f} / "
            f"{g['peer_combine_logical']:.1f}); concurrent copy ceiling {g['ceiling']:.1f}"
        )
        print(
            f"  {'':<16} peer d+c / NCCL d+c {r['peer_dispatch_combine_vs_nccl']:.2f}; EP{G} layer / EP1 layer "
            f"{r['epn_layer_vs_ep1_layer']:.2f}; peer layer / NCCL layer {r['peer_layer_vs_nccl_layer']:.2f}; "
            f"SMs {run['sms']}"
        )
        for path, u in run["us"].items():
            if path.startswith("peer") and "dispatch_ll" in u:
                print(
                    f"  {'':<16} low-latency mode ({path}): dispatch {u['dispatch_ll']:.1f} + combine "
                    f"{u['combine_ll']:.1f} (reduce included) = {u['dispatch_ll'] + u['combine_ll']:.1f} us; "
                    f"layer {u['layer_ll']:.1f} us"
                )
        if "dispatch_fp8" in run["us"]["peer"]:
            u = run["us"]["peer"]
            print(
                f"  {'':<16} FP8 dispatch (e4m3, a scale per {FP8_BLOCK}): dispatch {u['dispatch_fp8']:.1f} us "
                f"(bf16 {u['dispatch']:.1f}), layer {u['layer_fp8']:.1f} us (bf16 {u['layer']:.1f}); NVLink bytes/rank "
                f"{g['nvlink_bytes_per_rank_fp8']:.0f} (bf16 {g['nvlink_bytes_per_rank']:.0f}), "
                f"{g['peer_dispatch_fp8_nvlink']:.1f} GB/s"
            )
            f64 = c["fp8_vs_float64_rel_err"]
            print(
                f"  {'':<16} FP8 accuracy: layer output vs bf16 dispatch {c['fp8_vs_bf16_rel_err']:.2e} (all "
                f"{c['rows']} rows), vs float64 {'not checked' if f64 is None else f'{f64:.2e}'} (sampled tokens); "
                f"bound {c['fp8_tolerance']}; EP{G} FP8 rows differing from EP1 FP8 "
                f"{c['fp8_rows_differ_from_ep1_fp8']}/{c['rows']}; after replays equal {c['fp8_after_replay_equal']}"
            )
        if "ll_phases" in run:
            from tray.programs.ep_moe.ll_phases import table

            for rank, entry in enumerate(run["ll_phases"]["per_rank"]):
                print(f"  {'':<16} low-latency phases, rank {rank}:")
                print("\n".join(table(entry, indent=" " * 20)))
        rel = c["ep1_vs_float64_rel_err"]
        rel_text = (
            "not checked"
            if rel is None
            else (f"{rel:.2e} on {c['ep1_ref_tokens']} tokens, {c['ep1_ref_experts_covered']} experts")
        )
        print(
            f"  {'':<16} checks: rows differing from EP1: peer {c['peer_rows_differ_from_ep1']}/{c['rows']}, "
            f"low-latency {c['ll_rows_differ_from_ep1']}/{c['rows']} (EP1's own {c['ep1_ll_rows_differ_from_ep1']}), "
            f"NCCL {c['nccl_rows_differ_from_ep1']}/{c['rows']}; after replays equal {c['after_replay_equal']}; "
            f"layout reports {c['layout_reports_ok']}; EP1 vs float64 {rel_text}; "
            f"{'PASSED' if c['passed'] else 'FAILED'}"
        )
    print("PASSED" if report["passed"] else "FAILED")


def plot(report: dict[str, Any], path: str) -> None:
    """Latency vs tokens per rank, per routing: the layer on each path, and dispatch+combine of peer and NCCL."""
    G = report["nprocs"]
    series: dict[str, tuple[list[float], list[float]]] = {}
    for routing in dict.fromkeys(r["routing"] for r in report["runs"]):
        runs = [r for r in report["runs"] if r["routing"] == routing]
        xs = [float(r["tokens_per_rank"]) for r in runs]
        for label, get in (
            (f"EP{G} peer layer", lambda r: r["us"]["peer"]["layer"]),
            (f"EP{G} NCCL layer", lambda r: r["us"]["nccl"]["layer"]),
            ("EP1 layer", lambda r: r["us"]["ep1"]["layer"]),
            ("peer dispatch+combine", lambda r: r["us"]["peer"]["dispatch"] + r["us"]["peer"]["combine"]),
            ("NCCL dispatch+combine", lambda r: r["us"]["nccl"]["dispatch"] + r["us"]["nccl"]["combine"]),
        ):
            series[f"{label} ({routing})"] = (xs, [get(r) for r in runs])
    s = report["shape"]
    plot_lines(
        path,
        series,
        title=f"EP MoE, {G} ranks: H {s['hidden']}, {s['experts']} experts, top-{s['topk']}",
        xlabel="tokens per rank",
        ylabel="µs (captured, median)",
    )
    print(f"ep-moe: plot written to {path}")


def partial_results(work: Path) -> dict[str, Any]:
    """What the trays wrote before one failed: {tray name: {"results": [each rank's result_*.json as far as
    it got], "samples": {file: [one dict per figure]}}} for the trays that started."""
    import json

    found: dict[str, Any] = {}
    for name in ("epn", "ep1"):
        out = work / name
        if not out.is_dir():
            continue
        results = []
        for f in sorted(out.glob("result_*.json")):
            try:
                results.append(json.loads(f.read_text()))
            except (OSError, ValueError) as exc:
                results.append({"file": f.name, "unreadable": str(exc)})
        samples = {}
        for f in sorted(out.glob("samples_*.jsonl")):
            lines = []
            for line in f.read_text().splitlines():
                try:
                    lines.append(json.loads(line))
                except ValueError:
                    continue  # NOTE: a line cut short by the kill
            samples[f.name] = lines
        found[name] = {"results": results, "samples": samples}
    return found


def salvage(a: EpBenchArgs, work: Path, error: str, wall_s: float) -> None:
    """After a failed tray: write what was measured before it (partial_results) to --json's path, marked
    partial, with the error; without --json say how many figures were lost."""
    partial = partial_results(work)
    figures = sum(len(v) for t in partial.values() for v in t["samples"].values())
    if a.json_path is None:
        print(f"ep-moe: {figures} figure(s) were taken before the failure; pass --json PATH to keep them",
              file=sys.stderr)
        return
    report = {"bench": "ep-moe", "partial": True, "error": error, "nprocs": a.nprocs, "backend": a.backend,
              "nccl_timing": a.nccl_timing, "wall_s": wall_s, "trays": partial}
    write_report(report, a.json_path, {})
    print(f"ep-moe: PARTIAL results ({figures} figure(s) taken before the failure) written to {a.json_path}",
          file=sys.stderr)


def run_ep_bench(a: EpBenchArgs) -> int:
    """Check, time, print, write JSON (and a plot). Returns the exit code: 0 passed, 1 failed."""
    validate(a)
    require_plot(a.plot_path)
    work, remove_work = work_dir("tray-ep-moe-" if a.keep else None)
    t0 = time.perf_counter()

    def done(what: str) -> None:  # NOTE: on stdout with the elapsed time, so a stuck stage shows which it is
        print(f"ep-moe: {what} ({time.perf_counter() - t0:.1f} s)", flush=True)

    try:
        stage("ep-moe", 1, 4, "routings, capacities and expected layouts")
        runs_n, runs_1, facts = prepare(a, work)
        max_cap = max(r["cap"] for r in runs_n)
        done(f"{len(runs_n)} runs prepared")
        try:
            where = (f"tray: {len(runs_n)} runs x SM budgets {','.join(a.budgets)}" if a.nnodes == 1 else
                     f"job of {a.nnodes} nodes ({a.nprocs // a.nnodes} ranks each): {len(runs_n)} runs, peer and NCCL")
            stage("ep-moe", 2, 4, f"EP{a.nprocs} {where}")
            per_rank = launch(a, a.nprocs, runs_n, {**launch_vars(a, max(a.tokens), max_cap), **ll_phase_vars(a)},
                              work, "epn")
            done(f"EP{a.nprocs} done")
            stage("ep-moe", 3, 4, f"EP1 tray: {len(runs_1)} runs and the float64 reference")
            ep1 = launch(a, 1, runs_1, launch_vars(a, a.nprocs * max(a.tokens), max_cap), work, "ep1")[0]
            done("EP1 done")
        except TrayFailed as exc:
            print(f"ep-moe: {exc}", file=sys.stderr)
            salvage(a, work, str(exc), time.perf_counter() - t0)
            return 1
        stage("ep-moe", 4, 4, "EP-N vs EP1 byte for byte, reports")
        runs = (summarize if a.nnodes == 1 else summarize_nodes)(a, per_rank, ep1, facts, work)
        done("checks summarized")
    finally:
        if a.keep:
            print(f"ep-moe: work files kept in {work}")
        remove_work()
    report = {
        "bench": "ep-moe",
        "nprocs": a.nprocs,
        "nnodes": a.nnodes,
        # across nodes: which path carried the exchange between them (peer tables stay within a node)
        "cross_node_path": CROSS_NODE_PATH if a.nnodes > 1 else None,
        "ranks_nnodes": sorted({r.get("nnodes", 1) for r in per_rank}),  # the node counts the EP-N ranks saw
        "backend": a.backend,
        "shape": {"hidden": a.hidden, "experts": a.experts, "topk": a.topk, "ffn": a.expert_dim},
        "capacity": a.capacity,
        "gemm": ran_gemm(a.gemm, per_rank, ep1),
        "nccl_timing": a.nccl_timing,
        "dispatch": list(a.dispatch),
        "seed": a.seed,
        "repeats": a.repeats,
        "runs": runs,
        "passed": all(r["checks"]["passed"] and r.get("ll_phases", {}).get("ok", True) for r in runs)
        and (not a.ll_phases or all("ll_phases" in r for r in runs)),
        "setup_s": {"epn": max(r["setup_s"] for r in per_rank), "ep1": ep1["setup_s"]},
        "wall_s": time.perf_counter() - t0,
    }
    write_report(report, a.json_path, {"device": per_rank[0].get("device"), "sms": per_rank[0].get("sms")})
    (print_report if a.nnodes == 1 else print_report_nodes)(report)
    if a.plot_path:
        plot(report, a.plot_path)
    return 0 if report["passed"] else 1
