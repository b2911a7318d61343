"""Peer allreduce (low-latency, one-shot, two-shot) vs NCCL, 8 B .. 64 MiB, and a TP MLP layer (`tray bench tp`).

    python bench/tp.py -n 4 [--sizes 8,4096] [--tokens 1,64] [--backend cuda] [--json bench/results/tp.json]

The work is in tray.programs.tp_mlp.bench; this script is the figure's entry point beside the others.
"""

from __future__ import annotations

import sys

from tray.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "tp", *sys.argv[1:]]))
