"""The host side of the low-latency one-shot allreduce (`tp_ll_allreduce`, and `tp_ll3_allreduce` with dense lines,
on the same state words): its state words, read after a sync, turned into named errors; its launch shapes (threads
per block, lines per thread, line format) as the bench sweeps them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tray.errors import UsageError, WaitedForRanks

STATE_WORDS = 4  # ll_state u64[4]: tickets, timed-out epoch, missing mask, refused


class LLTimeout(WaitedForRanks):
    """A low-latency allreduce waited past its timeout for a member's lines; names the group, the epoch (launch
    number), the waiting rank and the missing ranks."""

    def __init__(self, group: str, epoch: int, rank: int, missing: list[int], waited_s: float) -> None:
        super().__init__(f"low-latency allreduce on group {group}, launch {epoch}", group, epoch, rank, missing,
                         waited_s, "its lines never arrived: it died, hangs, ran another program, or was given "
                         "another count")


def check_state(words: Sequence[int], group: str, members: Sequence[int], index: int, timeout_ns: int) -> None:
    """Raise what `tp_ll_allreduce` recorded in `words` (ll_state, u64[4], read after a sync): LLTimeout when a
    wait timed out (words[2]: bit i = member i missing; words[1]: the launch), UsageError when a launch was
    refused (words[3]). `members` are the group's global ranks in member order, `index` this rank's."""
    if len(words) != STATE_WORDS:
        raise UsageError(f"ll_state holds {len(words)} words, expected {STATE_WORDS}")
    if words[3]:
        raise UsageError(
            f"low-latency allreduce on group {group}: a launch was refused (count above ll_max_count, or a group of "
            f"more than 64 members, or a grid above 2^20 blocks); raise ll_max_count (tray launch --var "
            "ll_max_count=N) or send larger messages through the one-shot or two-shot")
    mask = int(words[2])
    if mask:
        missing = [rank for i, rank in enumerate(members) if mask >> i & 1]
        raise LLTimeout(group, int(words[1]), members[index], missing, timeout_ns / 1e9)


# NOTE: the launch shape of `tp_ll_allreduce` (manifest vars ll_threads, ll_lines): a block of ll_threads threads,
# each sending and summing ll_lines lines of 4 bf16, so grid = ceil(count / (4 * ll_threads * ll_lines)); vars
# ll3_threads, ll3_lines launch `tp_ll3_allreduce` the same way with lines of 6 bf16 (128 threads by default: on
# 2x H200 it was the faster block from 2 KiB up, bench/results/h200x2/tp_ll.json). The kernels take 82 and 92
# registers per thread for sm_90 (NVRTC 12.9; nvcc 13.0): a block of 1024 would need 84k / 94k of an SM's 64k
# registers and cannot launch, 512 fits.
MAX_BLOCK_THREADS = 512
MAX_LINES_PER_THREAD = 64


# the line formats by their --ll-shapes name: the bench program of each (2 bf16 | 32-bit flag; 3 bf16 | 16-bit flag)
LL_FORMATS = {"ll": "ar_ll", "ll3": "ar_ll3"}
# the manifest vars naming each program's launch shape: <prefix>_threads, <prefix>_lines
LL_VAR_PREFIX = {"ar_ll": "ll", "ar_ll3": "ll3"}


@dataclass(frozen=True)
class LLShape:
    """A launch shape of the low-latency allreduce: `threads` per block (a multiple of 32, <= 512) and `lines`
    per thread (1 .. 64; a line is 4 bf16 in `ar_ll`, 6 in `ar_ll3`), for the line format of `program`."""

    threads: int
    lines: int
    program: str = "ar_ll"

    @property
    def key(self) -> str:
        """The bench's key for this shape: `ar_ll[t512,l2]`, `ar_ll3[t128,l1]`."""
        return f"{self.program}[t{self.threads},l{self.lines}]"

    def vars(self) -> dict[str, int]:
        """The manifest vars that launch this shape (ll_threads / ll_lines for `ar_ll`, ll3_threads / ll3_lines
        for `ar_ll3`: each format has its own default shape)."""
        prefix = LL_VAR_PREFIX[self.program]
        return {f"{prefix}_threads": self.threads, f"{prefix}_lines": self.lines}


def parse_ll_shapes(text: str) -> tuple[LLShape, ...]:
    """`threads=256,512;lines=1,2[;formats=ll,ll3]` -> every (format, threads, lines), format-major, then
    threads-major. A missing axis is the manifest default's (threads 256, lines 1) or format ll alone. Raises
    UsageError naming what is wrong."""
    axes: dict[str, list[int]] = {}
    formats: dict[str, list[str]] = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        name, eq, values = part.partition("=")
        name = name.strip()
        if not eq or name not in ("threads", "lines", "formats") or name in (*axes, *formats):
            raise UsageError(f"--ll-shapes {text!r}: expected 'threads=N,N;lines=N,N[;formats=ll,ll3]' (each axis "
                             f"once), got {part!r}")
        if name == "formats":
            formats[name] = [f.strip() for f in values.split(",") if f.strip()]
            bad_f = [f for f in formats[name] if f not in LL_FORMATS]
            if bad_f or not formats[name]:
                raise UsageError(f"--ll-shapes {text!r}: formats are {', '.join(LL_FORMATS)}, got {values!r}")
            continue
        try:
            axes[name] = [int(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise UsageError(f"--ll-shapes {text!r}: {name} must be comma-separated integers, got {values!r}") from None
        if not axes[name]:
            raise UsageError(f"--ll-shapes {text!r}: {name} lists no value")
    threads, lines = axes.get("threads", [256]), axes.get("lines", [1])
    bad_t = [t for t in threads if t < 32 or t > MAX_BLOCK_THREADS or t % 32]
    bad_l = [n for n in lines if not 1 <= n <= MAX_LINES_PER_THREAD]
    if bad_t or bad_l:
        raise UsageError(f"--ll-shapes {text!r}: threads must be multiples of 32 in 32 .. {MAX_BLOCK_THREADS} (got "
                         f"{bad_t or 'ok'}), lines 1 .. {MAX_LINES_PER_THREAD} (got {bad_l or 'ok'})")
    programs = [LL_FORMATS[f] for f in formats.get("formats", ["ll"])]
    return tuple(dict.fromkeys(LLShape(t, n, p) for p in programs for t in threads for n in lines))
