"""The head of a tray: spawn, rendezvous, supervise (`tray launch`)."""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys

from tray.errors import UsageError
from tray.launch.spec import Failure, RankState, TrayResult, TraySpec
from tray.numa import NumaPlacement, placement_for

__all__ = ["Failure", "RankState", "TrayResult", "TraySpec", "placements_for", "run_tray"]


def placements_for(backend: str, nprocs: int, share: bool | None = None) -> list[NumaPlacement]:
    """Where each rank runs: its GPU's NUMA node and CPUs; unbound (said once) without information. `share`:
    ranks may share GPUs (None: TRAY_SHARE_GPUS)."""
    buses: list[str | None] = [None] * nprocs
    if backend == "cuda":
        from tray.backend.cuda import pci_bus_ids
        from tray.launch.pick import devices_for

        found = pci_bus_ids()
        buses = [found[d] if d < len(found) else None for d in devices_for(backend, nprocs, share)]
    placements = [placement_for(b) for b in buses]
    if backend == "cuda" and not any(p.bound for p in placements):
        print("tray: NUMA: no node information for the GPUs (sysfs numa_node -1); ranks are not bound",
              file=sys.stderr, flush=True)
    return placements


# exit codes after which `--max-restarts` starts the tray again: a rank failed, the handshake failed
RESTARTABLE_EXIT_CODES = (1, 3)


def run_tray(spec: TraySpec, placements: list[NumaPlacement] | None = None) -> TrayResult:
    """Launch `spec`, supervise it to the end, and return the outcome. After a failure (a rank
    failed, the handshake failed), tear down and start again, up to `spec.max_restarts` times; each
    attempt's ranks see TRAY_RESTART_COUNT (and TORCHELASTIC_RESTART_COUNT) = attempts before it.
    The result is the last attempt's. Raises SetupError/ManifestError/UsageError before any rank runs."""
    from tray.launch.head import Head

    if not spec.cmd or not all(isinstance(a, str) and a for a in spec.cmd[:1]):
        raise UsageError(f"TraySpec.cmd is the command each rank runs, e.g. (sys.executable, 'prog.py'); got "
                         f"{spec.cmd!r}")
    where = placements or placements_for(spec.backend, spec.nprocs, spec.share_gpus)
    if spec.run_id is None:  # one per launch: a restart is the same run (checkpoints keyed on it resume)
        spec = dataclasses.replace(spec, run_id=f"tray-{os.getpid()}-{secrets.token_hex(4)}")
    attempt = 0
    while True:
        result = Head(spec, where, restart_count=attempt).run()
        result.attempts = attempt + 1
        if result.interrupted and spec.max_restarts and result.exit_code in RESTARTABLE_EXIT_CODES:
            print(f"tray: attempt {attempt + 1} of {spec.max_restarts + 1} failed (exit {result.exit_code}) and "
                  f"{result.interrupted} came meanwhile: no restart", file=sys.stderr, flush=True)
            return result
        if result.exit_code not in RESTARTABLE_EXIT_CODES or attempt >= spec.max_restarts:
            if spec.max_restarts and result.exit_code in RESTARTABLE_EXIT_CODES:
                print(f"tray: attempt {attempt + 1} of {spec.max_restarts + 1} failed too (exit {result.exit_code}); "
                      f"no restart left (--max-restarts {spec.max_restarts})", file=sys.stderr, flush=True)
            return result
        attempt += 1
        cause = result.root_cause.summary if result.root_cause else f"exit {result.exit_code}"
        print(f"tray: attempt {attempt} of {spec.max_restarts + 1} failed (exit {result.exit_code}): {cause}; "
              f"restarting ({attempt} of {spec.max_restarts} restarts)", file=sys.stderr, flush=True)
