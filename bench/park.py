"""Park/wake GB/s per rank and tray-wide vs the pinned-copy ceiling (same as `tray bench park`).

    python bench/park.py -n 4 [--backend host|cuda] [--gib G] [--page-mib 2] [--repeats 5] [--json PATH]

The work is in tray.programs.park.bench; this script is the figure's entry point beside the others.
"""

from __future__ import annotations

import sys

from tray.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "park", *sys.argv[1:]]))
