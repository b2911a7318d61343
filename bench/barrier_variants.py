"""Kernel variants of the peer barrier, timed by the gate in one run (keeps the faster correct one).

Each variant is timed (`tray gate peer-barrier`) and then stressed (`--stress`: producer -> barrier ->
consumer rounds through peer pointers, checked on the device): a variant is correct only when its stress
finds no wrong word. `v4_nofence` drops the release fence on purpose: its stress should fail.
`prev_production` is the kernel the production one replaced (every thread fences and stores, the epoch handed
out through shared memory and `__syncthreads`, relaxed polling and one `ld.acquire.sys` after it), timed again
beside it; the production kernel is that one's v12 (the epoch by `__shfl_sync`, every poll an acquire: 2.23
against 2.35 µs captured on 2x H200, stress clean, bench/results/h200x2/tune_variants.json). `prev2_production`
is the kernel before that (thread 0 fences, then stores to every member); v4_nofence..v7 are variants of it,
v9..v13 of prev_production: v9 polls with `ld.acquire.sys`, v10 hands the epoch out by `__shfl_sync` (no shared
memory, no `__syncthreads`), v11 stores the flag with `st.release.sys` (no separate fence), v13 lets the next
barrier in (`griddepcontrol.launch_dependents`) after the flag store instead of at the top. Every diff is now
taken against the production kernel; the variants' own sources are the same as before.

Each variant is the production kernel (manifests/kernels/peer_barrier.cu, read from the installed package)
with a unified diff from barrier_variants/<name>.diff applied at run time: every hunk must match the
production source exactly once, so a variant that no longer fits the kernel is an error, never a stale
copy. The gate runs with TRAY_KERNEL_DIR pointing at the generated source.

    python bench/barrier_variants.py -n 4 [--only production,v9_parallel_acqpoll,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tray.backend.cuda.barrier import BARRIER_SOURCE
from tray.bench import median, write_report
from tray.launch.jobdir import scratch_dir
from tray.manifest.builtin import kernel_dir
from tray.programs.peer_barrier.gate import GateArgs, run_gate

PATCHES = Path(__file__).resolve().parent / "barrier_variants"


@dataclass(frozen=True)
class Variant:
    name: str
    diff: str | None  # file under barrier_variants/; None: the production kernel itself
    pdl: bool  # launch with programmatic stream serialization (needs `griddepcontrol.wait` in the kernel)


# v0/v2 predate `griddepcontrol.wait`, so they run without PDL
VARIANTS = (
    Variant("production", None, True),
    Variant("prod-nopdl", None, False),
    Variant("prev_production", "prev_production.diff", True),
    Variant("prev2_production", "prev2_production.diff", True),
    Variant("v0", "v0.diff", False),
    Variant("v2", "v2.diff", False),
    Variant("v4_nofence", "v4_nofence.diff", True),
    Variant("v5_acqpoll", "v5_acqpoll.diff", True),
    Variant("v6_fencefirst", "v6_fencefirst.diff", True),
    Variant("v7_fencefirst_acqpoll", "v7_fencefirst_acqpoll.diff", True),
    Variant("v9_parallel_acqpoll", "v9_parallel_acqpoll.diff", True),
    Variant("v10_shfl", "v10_shfl.diff", True),
    Variant("v11_strelease", "v11_strelease.diff", True),
    Variant("v13_late_dependents", "v13_late_dependents.diff", True),
)


class PatchError(ValueError):
    """A variant's diff does not apply to the production kernel."""


def hunks(diff: str) -> list[tuple[str, str]]:
    """The (old, new) text of each hunk of a unified diff (context lines in both)."""
    out: list[tuple[str, str]] = []
    old: list[str] | None = None
    new: list[str] = []
    for line in diff.splitlines(keepends=True):
        if line.startswith(("---", "+++")) and old is None:
            continue
        if line.startswith("@@"):
            if old is not None:
                out.append(("".join(old), "".join(new)))
            old, new = [], []
        elif old is not None:
            tag, text = line[:1], line[1:]
            if tag in (" ", "-"):
                old.append(text)
            if tag in (" ", "+"):
                new.append(text)
    if old is not None:
        out.append(("".join(old), "".join(new)))
    return out


def apply_diff(source: str, diff: str, what: str) -> str:
    """`source` with every hunk of `diff` applied. Raises PatchError naming the hunk that does not match
    exactly once (the production kernel changed: regenerate the diff from a fresh copy of it)."""
    parts = hunks(diff)
    if not parts:
        raise PatchError(f"{what}: no hunks")
    for i, (old, new) in enumerate(parts):
        count = source.count(old)
        if count != 1:
            first = old.strip().splitlines()[0] if old.strip() else "(empty)"
            raise PatchError(f"{what}: hunk {i + 1} matches the production kernel {count} times (expected once); "
                             f"it starts {first!r}: update the diff to the current {BARRIER_SOURCE}")
        source = source.replace(old, new, 1)
    return source


def variant_source(v: Variant) -> str:
    """The CUDA source of variant `v` (the production kernel patched by its diff)."""
    production = (kernel_dir() / BARRIER_SOURCE).read_text()
    if v.diff is None:
        return production
    return apply_diff(production, (PATCHES / v.diff).read_text(), v.diff)


def select(only: str | None) -> tuple[Variant, ...]:
    """The variants named in `only` (comma-separated, in VARIANTS order; None: all). Raises ValueError
    naming the unknown names and the known ones."""
    if only is None:
        return VARIANTS
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = [v.name for v in VARIANTS]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"--only {only!r}: unknown variant(s) {unknown}; expected names among {known}")
    return tuple(v for v in VARIANTS if v.name in names)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--only", default=None, metavar="NAMES",
                    help="comma-separated variant names to run (default: every variant)")
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--stress-rounds", type=int, default=1000, help="rounds per stress graph (0: no stress)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        chosen = select(args.only)
    except ValueError as exc:
        ap.error(str(exc))
    results: dict[str, dict] = {}
    report = {"variants": results}
    with scratch_dir() as tmp:  # locked under the jobs root: the next tray removes it if this process is killed
        for v in chosen:
            kdir = Path(tmp) / v.name
            kdir.mkdir()
            (kdir / BARRIER_SOURCE).write_text(variant_source(v))
            os.environ["TRAY_BARRIER_PDL"] = "1" if v.pdl else "0"
            os.environ["TRAY_KERNEL_DIR"] = str(kdir)
            out = kdir / "gate.json"
            code = run_gate(GateArgs(nprocs=args.n, backend="cuda", iters=args.iters, json_path=str(out),
                                     quiet=True))
            gate = json.loads(out.read_text()) if out.exists() else {}
            r = {k: gate.get(k) for k in ("eager_us", "eager_sync_us", "captured_us", "passed")}
            per_rank = gate.get("per_rank") or []
            r["eager_host_us"] = median([p["eager_host_us"] for p in per_rank]) if per_rank else None
            r["exit_code"] = code
            if args.stress_rounds:
                out = kdir / "stress.json"
                code = run_gate(GateArgs(nprocs=args.n, backend="cuda", iters=args.stress_rounds, json_path=str(out),
                                         quiet=True, stress=True))
                stress = json.loads(out.read_text()) if out.exists() else {}
                r["stress_exit_code"] = code
                r["stress_mismatches"] = stress.get("mismatches")
                r["stress_passed"] = bool(stress.get("passed"))
            results[v.name] = r
            write_report(report, args.json)  # after every variant: a run stopped from outside keeps what it measured
    for key in ("TRAY_KERNEL_DIR", "TRAY_BARRIER_PDL"):
        os.environ.pop(key, None)
    print(f"{'variant':<22}{'eager':>9}{'host':>9}{'sync':>9}{'captured':>10}  stress (wrong words)")
    for name, r in results.items():
        verdict = "not run" if "stress_passed" not in r else (
            f"ok ({r['stress_mismatches']})" if r["stress_passed"] else
            f"FAILED ({r['stress_mismatches']}, exit {r['stress_exit_code']})")
        if r["eager_us"] is not None:
            print(f"{name:<22}{r['eager_us']:>9.2f}{r['eager_host_us']:>9.2f}{r['eager_sync_us']:>9.2f}"
                  f"{r['captured_us']:>10.2f}  {verdict}")
        else:
            print(f"{name:<22} failed (exit {r['exit_code']})  {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
