"""Where each line a rank writes goes: the terminal (prefixed `[rank R]`), its `--log-dir` file, both,
or neither; and how a log line is stamped. Pure: the output pump asks, this answers."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from tray.errors import UsageError

STDOUT, STDERR = 1, 2  # torchrun's bits for --tee and --redirects: 1 stdout, 2 stderr, 3 both
BOTH = STDOUT | STDERR


def check_streams(flag: str, value: int) -> int:
    """`value` of --tee/--redirects if it is 0..3. Raises UsageError saying what the numbers mean."""
    if value not in range(BOTH + 1):
        raise UsageError(f"{flag} expects 0 (none), 1 (stdout), 2 (stderr) or 3 (both), got {value}")
    return value


def parse_ranks_filter(text: str | None, nprocs: int) -> tuple[int, ...] | None:
    """`--local-ranks-filter 0,2` -> (0, 2); None or "" -> None (every rank). Raises UsageError for a
    rank outside 0..nprocs-1 or text that is not comma-separated integers."""
    if not text:
        return None
    try:
        ranks = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise UsageError(f"--local-ranks-filter expects comma-separated ranks like 0,2, got {text!r}") from None
    outside = [r for r in ranks if not 0 <= r < nprocs]
    if outside or not ranks:
        raise UsageError(f"--local-ranks-filter {text}: ranks are 0..{nprocs - 1} with -n {nprocs}")
    return ranks


@dataclass(frozen=True)
class Routing:
    """Where rank streams go. `log_dir` None: no files. With a log dir and neither tee nor redirects,
    both streams go to the file and to the terminal (as --tee 3)."""

    log_dir: str | None = None
    tee: int = 0
    redirects: int = 0
    ranks: tuple[int, ...] | None = None  # ranks shown on the terminal; None: all
    quiet: bool = False  # nothing on the terminal

    def __post_init__(self) -> None:
        if (self.tee or self.redirects) and not self.log_dir:
            flag = "--redirects" if self.redirects else "--tee"
            raise UsageError(f"{flag} needs --log-dir DIR: it says which streams go to the per-rank files there")

    def to_log(self, stream: int) -> bool:
        """Whether lines of `stream` (STDOUT or STDERR) go to the rank's log file."""
        if not self.log_dir:
            return False
        return not (self.tee or self.redirects) or bool((self.tee | self.redirects) & stream)

    def to_terminal(self, rank: int, stream: int) -> bool:
        """Whether lines of `stream` of `rank` are printed (prefixed) on the head's terminal."""
        if self.quiet or (self.ranks is not None and rank not in self.ranks):
            return False
        return not (self.redirects & stream)


def stamp(now: datetime.datetime | None = None) -> str:
    """A log line's timestamp: local ISO 8601 with milliseconds, e.g. 2026-11-30T13:21:05.123."""
    return (now or datetime.datetime.now()).isoformat(timespec="milliseconds")
