"""`tray bench park`: its argument parser (light: no numpy until the bench runs)."""

from __future__ import annotations

import argparse
import math

from tray.bench.cli import add_tray_args, backend_and_nprocs


def _positive(text: str) -> float:
    """A size in GiB or MiB: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    if value > _MOST:  # past any host's memory (and, in bytes, past the manifest's 2**63)
        raise argparse.ArgumentTypeError(f"expected at most {_MOST} (a size any machine holds), got {text!r}")
    return value


_MOST = 1 << 20  # GiB or MiB


def add_bench_parser(benches: argparse._SubParsersAction) -> None:
    """Add `park` to the `tray bench` subcommands."""
    b = benches.add_parser("park", help="park/wake GB/s per rank and tray-wide vs the pinned-copy ceiling")
    add_tray_args(b)
    b.add_argument("--gib", type=_positive, default=None, help="GiB leased per rank (default 4 on cuda, 0.25 on host)")
    b.add_argument("--page-mib", type=_positive, default=2.0, help="page size in MiB (default 2)")
    b.add_argument("--repeats", type=int, default=5, help="park/wake repeats per round (median)")
    b.add_argument("--ceiling-repeats", type=int, default=None, help=argparse.SUPPRESS)
    b.add_argument("--plot", default=None, metavar="PNG",
                   help="GB/s vs ranks moving at once as a PNG (the `plot` extra)")
    b.set_defaults(fn=cmd_bench_park)


def cmd_bench_park(args: argparse.Namespace) -> int:
    from tray.bench import check_report_path
    from tray.programs.park.bench import CEILING_REPEATS, run

    backend, nprocs = backend_and_nprocs(args)
    check_report_path(args.json)
    return run(nprocs, backend, args.gib, args.page_mib, args.repeats, args.json,
               args.ceiling_repeats or CEILING_REPEATS, args.plot)
