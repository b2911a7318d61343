"""Page ids, as pure data: the free list of one page pool, and page pairs folded into copy runs.

No backend, no numpy: the allocator and the folding are what decide how many copies a park makes and
which pages a lease gets, so they are tested on their own (tests/unit/test_park_pure.py).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CopyRun:
    """`npages` consecutive pages from page `src` of one pool to page `dst` of another (ids, not bytes)."""

    src: int
    dst: int
    npages: int


def fold_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[CopyRun]:
    """The pairs (src_pages[i], dst_pages[i]), in order, folded into runs where both ids step by +1.

    [4, 5, 6, 9] -> [0, 1, 2, 3] gives CopyRun(4, 0, 3), CopyRun(9, 3, 1): one copy per run.
    Raises ValueError if the two sequences differ in length.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"fold_runs: {len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[CopyRun] = []
    start_src = start_dst = -1
    count = 0
    for s, d in zip(src_pages, dst_pages):
        if count and s == start_src + count and d == start_dst + count:
            count += 1
            continue
        if count:
            runs.append(CopyRun(start_src, start_dst, count))
        start_src, start_dst, count = s, d, 1
    if count:
        runs.append(CopyRun(start_src, start_dst, count))
    return runs


def page_runs(pages: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted page ids as half-open runs [start, stop): {7, 1, 2, 3} -> [(1, 4), (7, 8)]."""
    runs: list[tuple[int, int]] = []
    for p in sorted(pages):
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


class PageAllocator:
    """The free list of a pool of `npages` pages (ids 0..npages-1), kept as sorted disjoint runs.

    `allocate` hands out the lowest free ids first, so a pool that is not fragmented gives contiguous
    pages (one copy per lease on park and wake). Freeing merges runs back.
    """

    def __init__(self, npages: int) -> None:
        if npages < 0:
            raise ValueError(f"a page pool needs npages >= 0, got {npages}")
        self.npages = npages
        self._starts: list[int] = [0] if npages else []
        self._stops: list[int] = [npages] if npages else []
        self.free_count = npages

    @property
    def used_count(self) -> int:
        return self.npages - self.free_count

    def free_runs(self) -> list[tuple[int, int]]:
        """The free ids as sorted half-open runs [start, stop)."""
        return list(zip(self._starts, self._stops))

    def allocate(self, count: int) -> tuple[int, ...] | None:
        """`count` page ids, lowest first (ascending); None (and nothing taken) if fewer are free."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} pages")
        if count > self.free_count:
            return None
        out: list[int] = []
        need = count
        while need:
            start, stop = self._starts[0], self._stops[0]
            take = min(need, stop - start)
            out.extend(range(start, start + take))
            need -= take
            if start + take == stop:
                del self._starts[0], self._stops[0]
            else:
                self._starts[0] = start + take
        self.free_count -= count
        return tuple(out)

    def free(self, pages: Iterable[int]) -> None:
        """Return `pages` to the pool. Raises ValueError (and frees nothing) for an id out of range,
        given twice, or already free."""
        runs = page_runs(pages)
        if runs and (runs[0][0] < 0 or runs[-1][1] > self.npages):
            raise ValueError(f"page ids {runs[0][0]}..{runs[-1][1] - 1} out of range 0..{self.npages - 1}")
        for (_, prev_stop), (start, _) in itertools.pairwise(runs):
            if start < prev_stop:
                raise ValueError(f"page {start} given twice")
        for start, stop in runs:
            i = bisect.bisect_right(self._starts, start)
            if (i and self._stops[i - 1] > start) or (i < len(self._starts) and self._starts[i] < stop):
                raise ValueError(f"pages {start}..{stop - 1}: some are already free (double free)")
        total = sum(stop - start for start, stop in runs)
        for start, stop in runs:
            self._insert(start, stop)
        self.free_count += total

    def _insert(self, start: int, stop: int) -> None:
        i = bisect.bisect_right(self._starts, start)
        merge_prev = i > 0 and self._stops[i - 1] == start
        merge_next = i < len(self._starts) and self._starts[i] == stop
        if merge_prev and merge_next:
            self._stops[i - 1] = self._stops[i]
            del self._starts[i], self._stops[i]
        elif merge_prev:
            self._stops[i - 1] = stop
        elif merge_next:
            self._starts[i] = start
        else:
            self._starts.insert(i, start)
            self._stops.insert(i, stop)
