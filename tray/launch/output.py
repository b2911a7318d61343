"""Where each line a rank writes goes: the terminal (prefixed `[rank R]`), its `--log-dir` file, both,
or neither; and how a log line is stamped. Pure: the output pump asks, this answers."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from tray.errors import UsageError

STDOUT, STDERR = 1, 2  # torchrun's bits for --tee and --redirects: 1 stdout, 2 stderr, 3 both
BOTH = STDOUT | STDERR


# One value for every local rank (an int), or one per local rank (a tuple indexed by local rank).
Streams = int | tuple[int, ...]
_NUMBERS = "0 (none), 1 (stdout), 2 (stderr) or 3 (both)"


def check_streams(flag: str, value: int) -> int:
    """`value` of --tee/--redirects if it is 0..3. Raises UsageError saying what the numbers mean."""
    if value not in range(BOTH + 1):
        raise UsageError(f"{flag} expects {_NUMBERS}, got {value}")
    return value


def parse_streams(flag: str, text: str, nprocs: int) -> Streams:
    """--tee/--redirects as torchrun takes them: "3" -> 3 (every local rank); "0:3,1:2" -> (3, 2, 0, ...),
    one value per local rank 0..nprocs-1, 0 for ranks not listed. Raises UsageError (one line: what was
    expected, what was seen) for a value outside 0..3, a rank outside 0..nprocs-1, a rank listed twice, or
    an item that is not LOCAL_RANK:VALUE."""
    expected = f"{flag} expects {_NUMBERS} for every rank, or LOCAL_RANK:VALUE,... like 0:3,1:2"
    if ":" not in text:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{expected}; got {text!r}") from None
        return check_streams(flag, value)
    values = [0] * nprocs
    seen: set[int] = set()
    for item in text.split(","):
        rank_text, _, value_text = item.partition(":")
        try:
            rank, value = int(rank_text), int(value_text)
        except ValueError:
            raise UsageError(f"{expected}; got item {item.strip()!r} in {text!r}") from None
        if not 0 <= rank < nprocs:
            raise UsageError(f"{flag} {text}: local rank {rank} is not one of 0..{nprocs - 1} (-n {nprocs})")
        if rank in seen:
            raise UsageError(f"{flag} {text}: local rank {rank} is listed twice; give each rank once")
        if value not in range(BOTH + 1):
            raise UsageError(f"{flag} {text}: local rank {rank} is given {value}; values are {_NUMBERS}")
        seen.add(rank)
        values[rank] = value
    return tuple(values)


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
    """Where rank streams go. `log_dir` None: no files. `tee`/`redirects` per local rank (rank -
    `rank_base`), as parse_streams gives them; with a log dir, a rank given neither (0 in both) sends both
    streams to its file and to the terminal (as --tee 3)."""

    log_dir: str | None = None
    tee: Streams = 0
    redirects: Streams = 0
    ranks: tuple[int, ...] | None = None  # ranks shown on the terminal; None: all
    quiet: bool = False  # nothing on the terminal
    rank_base: int = 0  # the global rank of local rank 0 (a node of a job of several)

    def __post_init__(self) -> None:
        if self.log_dir == "":  # an unset variable ($LOGDIR): no logs kept, without a word
            raise UsageError("--log-dir needs a directory, got an empty one (an unset variable?); give one, or leave "
                             "--log-dir out to keep no log files")
        given = [flag for flag, value in (("--redirects", self.redirects), ("--tee", self.tee))
                 if any(value if isinstance(value, tuple) else (value,))]
        if given and not self.log_dir:
            raise UsageError(f"{given[0]} needs --log-dir DIR: it says which streams go to the per-rank files there")

    def _bits(self, value: Streams, rank: int) -> int:
        if isinstance(value, int):
            return value
        local = rank - self.rank_base
        return value[local] if 0 <= local < len(value) else 0

    def to_log(self, rank: int, stream: int) -> bool:
        """Whether lines of `stream` (STDOUT or STDERR) of `rank` go to the rank's log file."""
        if not self.log_dir:
            return False
        bits = self._bits(self.tee, rank) | self._bits(self.redirects, rank)
        return not bits or bool(bits & stream)

    def to_terminal(self, rank: int, stream: int) -> bool:
        """Whether lines of `stream` of `rank` are printed (prefixed) on the head's terminal."""
        if self.quiet or (self.ranks is not None and rank not in self.ranks):
            return False
        # NOTE: as torchrun, a stream both redirected and teed is shown too (tee: the file AND the terminal)
        return not (self._bits(self.redirects, rank) & stream) or bool(self._bits(self.tee, rank) & stream)


def stamp(now: datetime.datetime | None = None) -> str:
    """A log line's timestamp: local ISO 8601 with milliseconds, e.g. 2026-11-30T13:21:05.123."""
    return (now or datetime.datetime.now()).isoformat(timespec="milliseconds")
