"""What every `tray bench NAME` parser shares (light: no numpy until a bench runs)."""

from __future__ import annotations

import argparse

from tray.errors import UsageError


def ints(text: str) -> tuple[int, ...]:
    """argparse type: "1,2,3" -> (1, 2, 3)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def words(text: str) -> tuple[str, ...]:
    """argparse type: "a,b" -> ("a", "b")."""
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values:
        raise argparse.ArgumentTypeError("expected at least one comma-separated value")
    return values


def add_tray_args(b: argparse.ArgumentParser) -> None:
    """-n, --backend, --json: the tray a bench runs on and where its report goes."""
    b.add_argument("-n", "--nprocs", type=int, default=None, help="ranks (default: visible GPUs, or 4)")
    b.add_argument("--backend", choices=("host", "cuda"), default=None)
    b.add_argument("--json", default=None, help="write the report here")


def add_program_args(b: argparse.ArgumentParser) -> None:
    """add_tray_args plus what a rank-program bench takes: --seed, --repeats, --log-dir, --keep."""
    add_tray_args(b)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--repeats", type=int, default=None, help="timed replays per figure (median)")
    b.add_argument("--log-dir", default=None, help="keep one log file per rank here")
    b.add_argument("--keep", action="store_true", help="keep the work directory (plans, outputs)")


def backend_and_nprocs(args: argparse.Namespace) -> tuple[str, int]:
    """The tray of a parsed bench command line. Raises UsageError for a bad -n, backend or --repeats."""
    from tray.launch.pick import backend_and_nprocs as pick

    backend, nprocs = pick(args.backend, args.nprocs)
    repeats = getattr(args, "repeats", None)
    if repeats is not None and repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {repeats}")
    return backend, nprocs
