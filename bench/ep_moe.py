"""EP MoE layer: peer-buffer dispatch/combine vs NCCL all-to-all vs EP1 (same as `tray bench ep-moe`).

    python bench/ep_moe.py -n 4 [--tokens 128,4096] [--backend cuda] [--json bench/results/ep_moe.json]
                           [--plot bench/results/ep_moe.png]

The work is in tray.programs.ep_moe.bench; this script is the figure's entry point beside the others.
"""

from __future__ import annotations

import sys

from tray.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "ep-moe", *sys.argv[1:]]))
