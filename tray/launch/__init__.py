"""The head of a tray: spawn, rendezvous, supervise (`tray launch`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tray.launch.spec import Failure, RankState, TrayResult, TraySpec
from tray.numa import NumaPlacement, placement_for

__all__ = ["Failure", "RankState", "TrayFailed", "TrayResult", "TraySpec", "placements_for", "run_rank_program",
           "run_tray"]


def placements_for(backend: str, nprocs: int) -> list[NumaPlacement]:
    """Where each rank runs: its GPU's NUMA node and CPUs; unbound (said once) without information."""
    buses: list[str | None] = [None] * nprocs
    if backend == "cuda":
        from tray.backend.cuda import pci_bus_ids

        found = pci_bus_ids()
        buses = [found[r] if r < len(found) else None for r in range(nprocs)]
    placements = [placement_for(b) for b in buses]
    if backend == "cuda" and not any(p.bound for p in placements):
        print("tray: NUMA: no node information for the GPUs (sysfs numa_node -1); ranks are not bound",
              file=sys.stderr, flush=True)
    return placements


def run_tray(spec: TraySpec, placements: list[NumaPlacement] | None = None) -> TrayResult:
    """Launch `spec`, supervise it to the end, and return the outcome."""
    from tray.launch.head import Head

    return Head(spec, placements or placements_for(spec.backend, spec.nprocs)).run()


class TrayFailed(RuntimeError):
    """A tray run by `run_rank_program` exited non-zero; the message carries its root cause."""


def run_rank_program(name: str, module: str, cfg: dict[str, Any], work: Path, *, nprocs: int, backend: str,
                     manifest: str, vars: dict[str, int], log_dir: str | None = None) -> list[dict[str, Any]]:
    """Launch `python -m module CFG.json` on `nprocs` ranks; each rank writes `result_*.json` into
    `cfg["out_dir"]` (set here to work/name). Returns those results in file-name order.

    Raises TrayFailed naming the root cause when the tray fails."""
    out = work / name
    out.mkdir()
    cfg_path = work / f"{name}.json"
    cfg_path.write_text(json.dumps({**cfg, "out_dir": str(out)}))
    spec = TraySpec(nprocs=nprocs, cmd=(sys.executable, "-m", module, str(cfg_path)), backend=backend,
                    manifest=manifest, vars=tuple(sorted(vars.items())), log_dir=log_dir, quiet=True)
    result = run_tray(spec)
    if result.exit_code != 0:
        cause = result.root_cause
        detail = f"{cause.summary}\n{cause.report}" if cause else "no root cause reported"
        raise TrayFailed(f"the {name} tray failed (exit {result.exit_code}): {detail}")
    return [json.loads(f.read_text()) for f in sorted(out.glob("result_*.json"))]
