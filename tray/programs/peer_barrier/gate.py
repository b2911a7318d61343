"""`tray gate peer-barrier`: launch a tray, time its barrier, or prove a dropped rank is named."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tray.bench import Row, format_table, median, write_report
from tray.envinfo import environment
from tray.envvars import own_python
from tray.errors import UsageError
from tray.launch import TraySpec, run_tray
from tray.launch.jobdir import work_dir
from tray.manifest.builtin import builtin_path

# NOTE: docs/design.md section 6: every surviving rank must name the dropped one within timeout + 0.5 s.
DROP_SLACK_S = 0.5
MANIFEST = "peer_barrier"  # built-in (package data), see tray.manifest.builtin
STRESS_MANIFEST = "peer_stress"
# NOTE: words per (parity, writer) slot: 1 MiB per slot on a GPU keeps every SM's stores in flight over
# NVLink when the barrier starts; the host backend checks in numpy, so it stays small there.
STRESS_WORDS = {"cuda": 1 << 18, "host": 1 << 12}


@dataclass(frozen=True)
class GateArgs:
    nprocs: int
    backend: str
    iters: int = 1000
    drop: int | None = None
    timeout_s: float = 2.0
    json_path: str | None = None
    log_dir: str | None = None
    quiet: bool = False
    stress: bool = False  # producer -> barrier -> consumer rounds checked on the device (iters = rounds)
    replays: int = 5
    skew_ns: int = 2000
    corrupt: int | None = None  # --stress: this rank sends one wrong word (the gate must then fail)
    warn: Callable[[], object] | None = None  # called once the arguments are checked (too many ranks for the cores)


def run_gate(args: GateArgs) -> int:
    """Run the gate; print a table; write JSON. Returns the exit code (0 = passed)."""
    if args.drop is not None and not 0 <= args.drop < args.nprocs:
        raise UsageError(f"--drop {args.drop} is not a rank of a {args.nprocs}-rank tray (0..{args.nprocs - 1})")
    if args.drop is not None and args.nprocs < 2:
        raise UsageError(f"--drop needs 2 ranks or more: the others must name the dropped one; got -n {args.nprocs}")
    if not (args.iters >= 1 and args.replays >= 1 and 0 < args.timeout_s < float("inf")):
        raise UsageError(f"--iters and --replays must be 1 or more and --timeout-s a number of seconds > 0; got "
                         f"--iters {args.iters}, --replays {args.replays}, --timeout-s {args.timeout_s}")
    if args.corrupt is not None and not args.stress:
        raise UsageError(f"--corrupt {args.corrupt} needs --stress (its rounds are where the wrong word is sent)")
    if args.corrupt is not None and not 0 <= args.corrupt < args.nprocs:
        raise UsageError(f"--corrupt {args.corrupt} is not a rank of a {args.nprocs}-rank tray "
                         f"(0..{args.nprocs - 1})")
    if args.warn is not None:
        args.warn()
    out_dir, remove_out_dir = work_dir(None)
    try:
        python, path = own_python()
        cmd = [*python, "-m", "tray.programs.peer_barrier.rank_program", "--iters", str(args.iters),
               "--timeout-s", str(args.timeout_s), "--out", str(out_dir)]
        if args.drop is not None:
            cmd += ["--drop", str(args.drop)]
        variables: tuple[tuple[str, int], ...] = ()
        if args.stress:
            cmd += ["--stress", "--replays", str(args.replays), "--skew-ns", str(args.skew_ns)]
            if args.corrupt is not None:
                cmd += ["--corrupt", str(args.corrupt)]
            variables = (("stress_words", STRESS_WORDS.get(args.backend, STRESS_WORDS["host"])),)
        spec = TraySpec(nprocs=args.nprocs, cmd=tuple(cmd), backend=args.backend,
                        manifest=str(builtin_path(STRESS_MANIFEST if args.stress else MANIFEST)),
                        vars=variables, log_dir=args.log_dir, quiet=args.quiet, extra_env=(("PYTHONPATH", path),))
        result = run_tray(spec)
        per_rank = []
        for r in range(args.nprocs):
            path = out_dir / f"rank-{r}.json"
            if path.exists():
                per_rank.append(json.loads(path.read_text()))
    finally:
        remove_out_dir()
    report = _report(args, result, per_rank)
    _print(report)
    write_report(report, args.json_path)
    if result.exit_code != 0:
        return result.exit_code
    return 0 if report["passed"] else 1


def _median(per_rank: list[dict], key: str) -> float | None:
    vals = [r[key] for r in per_rank if r.get(key) is not None]
    return median(vals) if vals else None


def barrier_rows(report: dict[str, Any]) -> list[Row]:
    """The medians as table rows: a barrier moves no payload, so size and count are 0 (#wrong: ranks that
    did not report)."""
    wrong = report["nprocs"] - len(report["per_rank"])
    return [Row(f"barrier {key[:-3]}", 0, 0, "none", report[key], wrong)
            for key in ("eager_us", "eager_sync_us", "captured_us", "eager_graph_us", "eager_kernel_us")
            if report.get(key) is not None]


def _report(args: GateArgs, result: Any, per_rank: list[dict]) -> dict:
    report: dict[str, Any] = {
        "gate": "peer-barrier", "backend": args.backend, "nprocs": args.nprocs, "iters": args.iters,
        "timeout_s": args.timeout_s, "drop": args.drop, "tray_exit_code": result.exit_code,
        "startup_s": result.startup_s,
        "timeline": {k: {"s": v[0], "slowest_rank": v[1]} for k, v in result.timeline.items()},
        "per_rank": per_rank,
        "environment": environment({"device": per_rank[0].get("device") if per_rank else None}),
    }
    complete = result.exit_code == 0 and len(per_rank) == args.nprocs
    if args.stress:
        report["stress"] = {"rounds": args.iters, "replays": args.replays, "skew_ns": args.skew_ns,
                            "corrupt": args.corrupt}
        report["mismatches"] = sum(r["stress"]["mismatches"] for r in per_rank)
        report["passed"] = complete and all(
            r["stress"]["mismatches"] == 0 and r["stress"]["rounds"] == r["stress"]["rounds_expected"]
            for r in per_rank)
        return report
    if args.drop is None:
        for key in ("eager_us", "eager_sync_us", "captured_us", "eager_graph_us", "eager_host_us",
                    "eager_graph_host_us", "eager_kernel_us", "eager_kernel_host_us"):
            report[key] = _median(per_rank, key)
        report["passed"] = complete
        return report
    bound = args.timeout_s + DROP_SLACK_S
    checks = []
    for r in per_rank:
        if r.get("dropped"):
            continue
        ok = r.get("missing") == [args.drop] and r.get("seconds", 1e9) <= bound
        checks.append({"rank": r["rank"], "named": r.get("missing"), "seconds": r.get("seconds"), "ok": ok,
                       "message": r.get("message")})
    report["drop_checks"] = checks
    report["drop_bound_s"] = bound
    report["passed"] = complete and len(checks) == args.nprocs - 1 and all(c["ok"] for c in checks)
    return report


def _print(report: dict) -> None:
    head = f"peer-barrier gate: {report['nprocs']} ranks, {report['backend']} backend"
    if "stress" in report:
        st = report["stress"]
        print(f"{head}, stress: {st['rounds']} rounds eager + {st['replays']} replays of a graph of "
              f"{st['rounds']} (produce -> barrier -> check), skew step {st['skew_ns']} ns")
        print(f"  {'rank':>4} {'rounds':>8} {'expected':>9} {'wrong words':>12} {'bad writers':>12} {'us/round':>9}")
        for r in report["per_rank"]:
            s = r["stress"]
            print(f"  {r['rank']:>4} {s['rounds']:>8} {s['rounds_expected']:>9} {s['mismatches']:>12} "
                  f"{str(s['bad_writers'] or '-'):>12} {s['captured_round_us']:>9.2f}")
    elif report["drop"] is None:
        print(f"{head}, {report['iters']} barriers per repeat (µs per barrier, median)")
        print(f"  {'rank':>4} {'eager':>10} {'eager_sync':>11} {'captured':>10} {'eager_graph':>12} "
              f"{'host/launch':>12} {'host/graph':>11}")
        for r in [*report["per_rank"], {**report, "rank": "all"}]:
            if r.get("eager_us") is None:
                continue
            print(f"  {r['rank']:>4} {r['eager_us']:>10.2f} {r['eager_sync_us']:>11.2f} {r['captured_us']:>10.2f} "
                  f"{r['eager_graph_us']:>12.2f} {r['eager_host_us']:>12.2f} {r['eager_graph_host_us']:>11.2f}"
                  + (f"  kernel launches: {r['eager_kernel_us']:.2f} us, host {r['eager_kernel_host_us']:.2f} us"
                     if r.get("eager_kernel_us") is not None else ""))
        if report.get("eager_us") is not None:
            print(format_table(barrier_rows(report)))
    else:
        print(f"{head}, rank {report['drop']} dropped, timeout {report['timeout_s']:.2f} s "
              f"(bound {report['drop_bound_s']:.2f} s)")
        for c in report.get("drop_checks", []):
            mark = "ok " if c["ok"] else "BAD"
            print(f"  {mark} rank {c['rank']}: named {c['named']} after {c['seconds']:.3f} s")
    if report.get("startup_s") is not None:
        print(f"  tray up in {report['startup_s']:.3f} s")
    print("PASSED" if report["passed"] else "FAILED")
