"""Unit tests of park/wake's pure parts: the page allocator, run folding, host-tier layout, the vote
verdicts (misuse, disagreement, no room) and the NUMA placement verdict."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tray.manifest import ResolvedState
from tray.numa.pool import Placement
from tray.park.pages import CopyRun, PageAllocator, fold_runs, page_runs
from tray.park.parking import disagreement, shortage
from tray.park.pools import HOST_TIER_ALIGN, host_layout


def test_allocate_lowest_first_and_contiguous():
    a = PageAllocator(10)
    assert a.allocate(3) == (0, 1, 2) and a.allocate(2) == (3, 4)
    assert a.free_count == 5 and a.used_count == 5 and a.free_runs() == [(5, 10)]
    a.free([0, 1, 2])
    assert a.free_runs() == [(0, 3), (5, 10)]
    assert a.allocate(4) == (0, 1, 2, 5)  # lowest first, across the hole
    assert a.allocate(7) is None and a.free_count == 4  # nothing taken when short
    assert a.allocate(0) == ()
    a.free([3, 4, 0, 5, 2, 1])  # any order; merges into one run
    assert a.free_runs() == [(0, 10)] and a.free_count == 10


def test_free_merges_both_sides_and_rejects_bad_ids():
    a = PageAllocator(8)
    ids = a.allocate(8)
    assert ids == tuple(range(8)) and a.free_runs() == []
    a.free([1])
    a.free([3])
    a.free([2])  # joins 1 and 3
    assert a.free_runs() == [(1, 4)]
    with pytest.raises(ValueError, match="double free"):
        a.free([3])
    with pytest.raises(ValueError, match="double free"):
        a.free([0, 1])
    with pytest.raises(ValueError, match="given twice"):
        a.free([5, 5])
    with pytest.raises(ValueError, match="out of range 0..7"):
        a.free([8])
    with pytest.raises(ValueError, match="out of range"):
        a.free([-1])
    assert a.free_runs() == [(1, 4)] and a.free_count == 3  # failed frees change nothing
    with pytest.raises(ValueError):
        a.allocate(-1)
    assert PageAllocator(0).allocate(1) is None and PageAllocator(0).allocate(0) == ()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=40))
def test_allocator_matches_a_set_model(npages, ops):
    a = PageAllocator(npages)
    free = set(range(npages))
    held: list[tuple[int, ...]] = []
    for alloc, k in ops:
        if alloc:
            got = a.allocate(k)
            if k > len(free):
                assert got is None
            else:
                assert got == tuple(sorted(free)[:k])
                free -= set(got)
                held.append(got)
        elif held:
            ids = held.pop(k % len(held))
            a.free(ids)
            free |= set(ids)
        assert a.free_count == len(free)
        assert [p for s, e in a.free_runs() for p in range(s, e)] == sorted(free)
        runs = a.free_runs()
        assert all(e1 < s2 for (_, e1), (s2, _) in itertools.pairwise(runs))  # disjoint, never adjacent


def test_fold_runs():
    assert fold_runs([], []) == []
    assert fold_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [CopyRun(4, 0, 3), CopyRun(9, 3, 1)]
    assert fold_runs([0, 1, 2, 3], [7, 8, 0, 1]) == [CopyRun(0, 7, 2), CopyRun(2, 0, 2)]
    assert fold_runs([3, 2, 1], [0, 1, 2]) == [CopyRun(3, 0, 1), CopyRun(2, 1, 1), CopyRun(1, 2, 1)]
    assert fold_runs(range(100), range(5, 105)) == [CopyRun(0, 5, 100)]
    with pytest.raises(ValueError, match="3 source pages but 2 destination pages"):
        fold_runs([1, 2, 3], [1, 2])


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), max_size=30))
def test_fold_runs_cover_every_pair_in_order(pairs):
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    runs = fold_runs(src, dst)
    expanded = [(r.src + k, r.dst + k) for r in runs for k in range(r.npages)]
    assert expanded == pairs
    for a, b in itertools.pairwise(runs):  # maximal: a run never continues into the next
        assert not (b.src == a.src + a.npages and b.dst == a.dst + a.npages)


def test_page_runs():
    assert page_runs([]) == []
    assert page_runs({7, 1, 2, 3}) == [(1, 4), (7, 8)]


def test_host_layout_aligns_each_tier():
    states = [
        ResolvedState("kv", 4096, 10, 3),
        ResolvedState("none", 4096, 4, 0),
        ResolvedState("big", 1 << 20, 2),
    ]
    assert states[2].host_pages == 2 and states[2].host_nbytes == 2 << 20  # host_pages defaults to pages
    layout = host_layout(states)
    assert layout.offsets == {"kv": 0, "none": HOST_TIER_ALIGN, "big": HOST_TIER_ALIGN}
    assert layout.nbytes == HOST_TIER_ALIGN + (2 << 20)
    assert host_layout([ResolvedState("z", 4096, 4, 0)]).nbytes == 0  # no pinned memory at all


def vote(op="park", session=1, state="kv", error=None, room=True, free=8, total=8, need=4):
    return {
        "op": op,
        "session": session,
        "state": state,
        "error": error,
        "room": room,
        "free": free,
        "total": total,
        "need": need,
        "nbytes": need * 4096,
    }


def test_disagreement_and_shortage_messages():
    ok = [vote(), vote(), vote()]
    assert disagreement("park", ok) is None and shortage("park", ok) is None
    msg = disagreement("park", [vote(), vote(error="session 1 was released; lease a new session"), vote()])
    assert msg == "park: rank 1: session 1 was released; lease a new session; nothing moved on any rank"
    msg = disagreement("park", [vote(), vote(op="wake"), vote(session=2), vote()])
    assert msg.startswith(
        "park: the ranks disagree: ranks 0,3 park session 1 of state 'kv', rank 1 wakes "
        "session 1 of state 'kv', rank 2 parks session 2 of state 'kv'; every rank must park"
    )
    msg = shortage(
        "park", [vote(), vote(room=False, free=3, total=12, need=5), vote(room=False, free=0, need=1)]
    )
    assert msg.startswith(
        "park: rank 1 host pool has 3 of 12 pages free, session 1 needs 5; rank 2 host pool "
        "has 0 of 8 pages free, session 1 needs 1; nothing moved on any rank; release sessions that hold host pages"
    )
    msg = shortage("wake", [vote(op="wake", room=False, free=2, total=32, need=4), vote(op="wake")])
    assert msg.startswith("wake: rank 0 device pool has 2 of 32 pages free, session 1 needs 4; nothing moved")
    assert "on rank 0, then wake again" in msg


def test_placement_verdict():
    assert Placement(-1).ok and "no NUMA node" in Placement(-1).describe()
    assert Placement(0).ok and not Placement(0).checked  # move_pages unavailable: nothing to judge
    on = Placement(0, {0: 100, -2: 5})  # untouched pages (-ENOENT) do not count against it
    assert on.ok and on.on_node == 100 and on.elsewhere == {}
    off = Placement(1, {0: 60, 1: 40})
    assert not off.ok and off.elsewhere == {0: 60}
    assert off.describe() == "expected node 1; 100 pages sampled (node 0: 60, node 1: 40)"
    assert "ENOENT: 5" in on.describe()
