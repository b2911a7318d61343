"""The head of a tray: spawn, rendezvous, supervise (`tray launch`)."""

from __future__ import annotations

import sys

from tray.launch.spec import Failure, RankState, TrayResult, TraySpec
from tray.numa import NumaPlacement, placement_for

__all__ = ["Failure", "RankState", "TrayResult", "TraySpec", "placements_for", "run_tray"]


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
