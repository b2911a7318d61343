"""TP MLP: one-shot peer allreduce vs NCCL allreduce, 512 B .. 4 MiB (same as `tray bench tp`).

    python bench/tp.py -n 4 [--sizes 512,...,4194304] [--backend cuda] [--json bench/results/tp.json]

The work is in tray/tp/bench.py; this script is the figure's entry point beside the others in bench/.
"""

from __future__ import annotations

import sys
from pathlib import Path


def run() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tray.cli import main

    return main(["bench", "tp", *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(run())
