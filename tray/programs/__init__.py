"""Programs that run on a tray, above the infrastructure: each holds its rank program, the host twins of
its kernels and its bench. The infrastructure (backend, collectives, handshake, launch, rank, park,
manifest, numa) never imports from here.

    ep_moe/        expert-parallel MoE layer: routing plans, rank program, twins, `tray bench ep-moe`
    tp_mlp/        tensor-parallel MLP with peer allreduces (low-latency, one-shot, two-shot), `tray bench tp`
    peer_barrier/  the peer-barrier gate (`tray gate peer-barrier`) and its rank program
    park/          park/wake throughput, `tray bench park`
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

GATES = ("peer-barrier",)
# NOTE: modules, not objects: `tray --help` imports each bench's light cli module only.
BENCH_CLIS = ("tray.programs.ep_moe.cli", "tray.programs.tp_mlp.cli", "tray.programs.park.cli")


def bench_parsers() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Each bench's `add_bench_parser(benches)`, in `tray bench` order."""
    return [importlib.import_module(name).add_bench_parser for name in BENCH_CLIS]
