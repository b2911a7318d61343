"""The host side of the low-latency one-shot allreduce (`tp_ll_allreduce`): its state words, read after a sync,
turned into named errors."""

from __future__ import annotations

from collections.abc import Sequence

from tray.errors import PeerFailure, UsageError

STATE_WORDS = 4  # ll_state u64[4]: tickets, timed-out epoch, missing mask, refused


class LLTimeout(PeerFailure):
    """A low-latency allreduce waited past its timeout for a member's lines; names the group, the epoch (launch
    number), the waiting rank and the missing ranks."""

    def __init__(self, group: str, epoch: int, rank: int, missing: list[int], waited_s: float) -> None:
        self.group = group
        self.epoch = epoch
        self.rank = rank
        self.missing = list(missing)
        self.waited_s = waited_s
        who = ",".join(str(m) for m in self.missing)
        super().__init__(
            f"low-latency allreduce on group {group}, launch {epoch}: rank {rank} waited {waited_s:.2f} s for rank "
            f"{who} (its lines never arrived: it died, hangs, ran another program, or was given another count)"
        )


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
