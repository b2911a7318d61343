"""Park/wake on the host backend: real 4-rank trays for the tray-wide protocol (round trips, NoRoom all or
nothing, a rank killed mid-park, parking twice), and one in-process rank for the session rules."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import MANIFESTS, REPO

from tray.backend.host import HostBackend
from tray.errors import NoRoom, UsageError
from tray.manifest import parse_manifest
from tray.numa.pool import check_placement, pages_on_node
from tray.park import Parking
from tray.rank.phases import PhaseClock

PARK = str(MANIFESTS / "park.json")


def park_vars(page_nbytes: int, pages: int, host_pages: int) -> list[str]:
    return [
        "--manifest",
        PARK,
        "--var",
        f"page_nbytes={page_nbytes}",
        "--var",
        f"pages={pages}",
        "--var",
        f"host_pages={host_pages}",
    ]


# Helpers every rank program below uses: fill a session's pages with random bytes, read them back.
HELPERS = """
def fill(backend, session, rng):
    data = rng.integers(0, 256, session.nbytes, dtype=np.uint8)
    for i in range(session.npages):
        backend.write(session.ptr(i), data[i * session.page_nbytes:(i + 1) * session.page_nbytes])
    return data

def read(backend, session):
    return np.concatenate([backend.read(session.ptr(i), session.page_nbytes) for i in range(session.npages)]
                          or [np.zeros(0, np.uint8)])
"""


def test_random_sessions_round_trip_byte_exact(tray_env):
    body = HELPERS + textwrap.dedent("""
    with tray.init() as rank:
        me, b = rank.rank, rank.backend
        rng = np.random.default_rng(100 + me)
        # rank-dependent sizes; A is released to fragment the pool, so C spans two page runs
        a = rank.lease(int(rng.integers(1, 6)))
        sb = rank.lease(int(rng.integers(0, 8)))
        a.release()
        sc = rank.lease(int(rng.integers(6, 12)))
        assert sb.id == 2 and sc.id == 3, (sb.id, sc.id)
        want_b, want_c = fill(b, sb, rng), fill(b, sc, rng)
        parking = sc.parking
        pb = rank.park(sb)
        pc = rank.park(sc)
        pool = parking.pool()
        b.write(pool.device.ptr, rng.integers(0, 256, pool.device_nbytes, dtype=np.uint8))  # garbage
        sc2 = rank.wake(pc)            # the other order
        sb2 = rank.wake(pb)
        assert np.array_equal(read(b, sc2), want_c) and np.array_equal(read(b, sb2), want_b)
        moved = parking.stats.bytes_copied
        assert moved == 2 * (sb.nbytes + sc.nbytes), (moved, sb.nbytes, sc.nbytes)
        assert parking.stats.copies >= 4

        # after a wake every page is dirty: parking again copies it all, and writes without touch() survive
        assert sc2.dirty == tuple(range(sc2.npages))
        page = sc2.page_nbytes
        new0 = rng.integers(0, 256, page, dtype=np.uint8)
        b.write(sc2.ptr(0), new0)
        want_c[:page] = new0
        again = rank.park(sc2)
        assert parking.stats.history[-1] == ("park", 3, sc.nbytes)
        moved = parking.stats.bytes_copied
        sc3 = rank.wake(again)
        assert parking.stats.bytes_copied == moved + sc.nbytes
        assert np.array_equal(read(b, sc3), want_c)
        # pages declared clean keep their host copy; only the others are copied
        new = rng.integers(0, 256, 2 * page, dtype=np.uint8)
        b.write(sc3.ptr(1), new[:page]); b.write(sc3.ptr(4), new[page:])
        want_c[page:2 * page], want_c[4 * page:5 * page] = new[:page], new[page:]
        sc3.mark_clean()
        sc3.touch([1, 4])
        assert sc3.dirty == (1, 4)
        last = rank.park(sc3)
        assert parking.stats.history[-1] == ("park", 3, 2 * page)
        b.write(pool.device.ptr, np.zeros(pool.device_nbytes, np.uint8))
        sc4 = rank.wake(last)
        assert np.array_equal(read(b, sc4), want_c)
        sc4.release(); sb2.release()
        assert pool.device_pages.free_count == pool.device_pages.npages
        assert pool.host_pages.free_count == pool.host_pages.npages
        print("round trip ok", sb.npages, sc.npages)
    """)
    run = tray_env.launch(4, body, *park_vars(4096, 32, 32))
    assert run.returncode == 0, run.output
    assert run.stdout.count("round trip ok") == 4, run.output


def test_no_room_on_one_rank_moves_nothing_anywhere(tray_env):
    body = HELPERS + textwrap.dedent("""
    from tray.errors import NoRoom, UsageError
    with tray.init() as rank:
        me, b = rank.rank, rank.backend
        rng = np.random.default_rng(7 + me)
        s = rank.lease(12 if me == 1 else 4)     # rank 1's host tier holds 8 pages: it is short
        want = fill(b, s, rng)
        parking = s.parking
        pool = parking.pool()
        host_before = b.read(pool.host_base, pool.host_nbytes)
        try:
            rank.park(s)
        except NoRoom as exc:
            print("NoRoom:", exc)
        else:
            raise AssertionError("park should have raised NoRoom")
        assert parking.stats.bytes_copied == 0 and parking.stats.copies == 0
        assert np.array_equal(b.read(pool.host_base, pool.host_nbytes), host_before)   # host tier untouched
        assert np.array_equal(read(b, s), want) and s.live                              # session untouched
        assert pool.host_pages.free_count == 8                                           # reservation dropped

        # ranks naming different sessions: UsageError everywhere, nothing moved
        other = rank.lease(1)
        try:
            rank.park(other if me == 2 else s)
        except UsageError as exc:
            print("Disagree:", exc)
        else:
            raise AssertionError("park should have raised UsageError")
        other.release()

        # a smaller session parks; then rank 3's device pool is too full for the wake
        s.release()
        s = rank.lease(4)
        want = fill(b, s, rng)
        parked = rank.park(s)
        blocker = rank.lease(30 if me == 3 else 1)        # rank 3: 2 of 32 pages left, needs 4
        device_before = b.read(pool.device.ptr, pool.device_nbytes)
        try:
            rank.wake(parked)
        except NoRoom as exc:
            print("NoRoom wake:", exc)
        else:
            raise AssertionError("wake should have raised NoRoom")
        assert np.array_equal(b.read(pool.device.ptr, pool.device_nbytes), device_before)
        assert parked.parked and parking.stats.wakes == 0
        blocker.release()
        s = rank.wake(parked)
        assert np.array_equal(read(b, s), want)
        print("recovered")
    """)
    run = tray_env.launch(4, body, *park_vars(4096, 32, 8))
    assert run.returncode == 0, run.output
    for r in range(4):
        assert (
            f"[rank {r}] NoRoom: park: rank 1 host pool has 8 of 8 pages free, session 1 needs 12; "
            "nothing moved on any rank"
        ) in run.stdout, run.output
        assert (
            f"[rank {r}] NoRoom wake: wake: rank 3 device pool has 2 of 32 pages free, session 3 needs 4; "
            "nothing moved on any rank"
        ) in run.stdout, run.output
        assert (
            f"[rank {r}] Disagree: park: the ranks disagree: ranks 0,1,3 park session 1 of state 'kv', "
            "rank 2 parks session 2 of state 'kv'" in run.stdout
        ), run.output
    assert run.stdout.count("recovered") == 4


def test_rank_killed_before_park_fails_the_tray_and_nobody_parks(tray_env):
    body = """
    with tray.init() as rank:
        s = rank.lease(4)
        rank.backend.write(s.ptr(0), np.ones(s.page_nbytes, np.uint8))
        if rank.rank == 2:
            os.kill(os.getpid(), 9)
        parked = rank.park(s)
        print("session parked", parked.id)
    """
    run = tray_env.launch(4, body, *park_vars(4096, 8, 8))
    assert run.returncode == 1, run.output
    first = [ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED")]
    assert first and "rank 2" in first[0] and "SIGKILL" in first[0], run.stderr
    assert "session parked" not in run.stdout
    assert run.seconds < 20


def test_bench_park_runs_tiny_on_host(tray_env, tmp_path):
    out = tmp_path / "park.json"
    run = tray_env.run(
        [
            sys.executable,
            "-m",
            "tray",
            "bench",
            "park",
            "-n",
            "2",
            "--backend",
            "host",
            "--gib",
            str(1 / 256),
            "--page-mib",
            "1",
            "--repeats",
            "2",
            "--json",
            str(out),
        ],
        timeout_s=120,
    )
    assert run.returncode == 0, run.output
    import json

    report = json.loads(out.read_text())
    assert report["bench"] == "park" and report["nprocs"] == 2 and report["checked_bytes"] > 0
    assert len(report["alone"]) == 2 and len(report["together"]["per_rank"]) == 2
    for row in report["alone"] + report["together"]["per_rank"] + report["fragmented"]["per_rank"]:
        assert row["park_gbps"] > 0 and row["wake_gbps"] > 0 and row["d2h_ceiling_gbps"] > 0
    pages = report["pages_per_rank"]  # 4 pages of 1 MiB: the partial park moves pages 0 (and 8, ...)
    assert [r["device_runs"] for r in report["together"]["per_rank"]] == [1, 1]
    assert [r["device_runs"] for r in report["fragmented"]["per_rank"]] == [pages, pages]
    assert all(r["partial_park_nbytes"] == -(-pages // 8) * report["page_nbytes"]
               for r in report["together"]["per_rank"] + report["fragmented"]["per_rank"])
    assert report["environment"]["commit"]
    assert "park" in run.stdout and "ceiling" in run.stdout


# --- one rank in this process: the session rules ---------------------------------------------------------


class OneRank:
    """What Parking needs of a RankContext, for one rank alone: an exchange of one is the value itself."""

    rank, world_size = 0, 1

    def __init__(
        self, pages: int = 16, host_pages: int = 8, page_nbytes: int = 4096, states: int = 1
    ) -> None:
        self.backend = HostBackend.open(0)
        doc = {
            "format": 1,
            "name": "t",
            "states": [
                {"name": n, "page_nbytes": page_nbytes, "pages": pages, "host_pages": host_pages}
                for n in ("kv", "ssm")[:states]
            ],
        }
        self.resolved = parse_manifest(doc, "<test>", ".").resolve(1)
        self.phases = PhaseClock()
        self.exchanges = 0

    def exchange(self, topic: str, value: object, timeout_s: float = 60.0) -> list[object]:
        self.exchanges += 1
        return [value]


@pytest.fixture
def one():
    r = OneRank()
    p = Parking(r)
    yield r, p
    p.close()
    r.backend.close()


def test_session_rules_and_messages(one):
    r, p = one
    s = p.lease(3)
    assert s.pages == (0, 1, 2) and s.ptr(1) == p.pool().device.ptr + 4096 and s.dirty == (0, 1, 2)
    with pytest.raises(UsageError, match=r"page index 3 is out of range for session 1 of 3 pages \(0..2\)"):
        s.ptr(3)
    with pytest.raises(UsageError, match="expects a ParkedSession"):
        p.wake(s)
    parked = p.park(s)
    assert r.exchanges == 3  # the refused wake voted too (one vote): ranks never drift apart
    with pytest.raises(UsageError, match="session 1 is parked and its device pages went back to the pool"):
        s.ptr(0)
    with pytest.raises(
        UsageError, match="park expects a Session .*got ParkedSession; to wake it, call rank.wake"
    ):
        p.park(parked)
    s2 = p.wake(parked)
    with pytest.raises(UsageError, match="parked session 1 was already woken"):
        p.wake(parked)
    with pytest.raises(UsageError, match="this handle of session 1 is stale"):
        p.park(s)
    s2.release()
    with pytest.raises(UsageError, match="session 1 was released; lease a new session"):
        p.park(s2)
    with pytest.raises(UsageError, match="session 1 was released"):
        s2.release()
    assert p.stats.parks == 1 and p.stats.wakes == 1


def test_lease_errors_and_no_room(one):
    _, p = one
    with pytest.raises(UsageError, match="pages must be >= 0"):
        p.lease(-1)
    with pytest.raises(UsageError, match="no state 'kvv'; the manifest declares: kv; did you mean 'kv'"):
        p.lease(1, "kvv")
    keep = p.lease(10)
    with pytest.raises(
        NoRoom, match="lease: rank 0 device pool of state 'kv' has 6 of 16 pages free, 7 needed"
    ):
        p.lease(7)
    with pytest.raises(NoRoom, match="more than the pool holds"):
        p.lease(17)
    with pytest.raises(NoRoom, match=r"park: rank 0 host pool has 8 of 8 pages free, session 1 needs 10"):
        p.park(keep)
    assert keep.live and p.pool().host_pages.free_count == 8 and p.stats.bytes_copied == 0
    with keep:
        pass
    assert not keep.live and p.pool().device_pages.free_count == 16
    empty = p.lease(0)  # a rank may hold no pages of a session
    p.wake(p.park(empty)).release()


def test_states_must_be_named_when_several():
    r = OneRank(states=2)
    p = Parking(r)
    try:
        with pytest.raises(UsageError, match="declares states kv, ssm; name one"):
            p.lease(1)
        a, b = p.lease(2, "kv"), p.lease(2, "ssm")
        assert a.state == "kv" and b.state == "ssm" and (a.id, b.id) == (1, 2)
        # two tiers in one pinned pool, each on a 2 MiB boundary
        assert p.pool("ssm").host_base - p.pool("kv").host_base == 2 << 20
    finally:
        p.close()
        r.backend.close()
    with pytest.raises(UsageError, match="park pools are closed"):
        a.ptr(0)


def test_pages_on_node_sees_touched_pages():
    import mmap

    region = mmap.mmap(-1, 16 * mmap.PAGESIZE)
    region[: 8 * mmap.PAGESIZE] = b"x" * (8 * mmap.PAGESIZE)
    buf = (np.ctypeslib.ctypes.c_char * len(region)).from_buffer(region)
    ptr = np.ctypeslib.ctypes.addressof(buf)
    counts = pages_on_node(ptr, len(region))
    if not counts:
        pytest.skip("move_pages(2) is not available here")
    nodes = {n for n in counts if n >= 0}
    assert sum(c for n, c in counts.items() if n >= 0) == 8 and counts.get(-2) == 8, counts
    assert check_placement(ptr, len(region), min(nodes)).ok
    assert not check_placement(ptr, len(region), max(nodes) + 1).ok
    assert pages_on_node(ptr, len(region), max_samples=3) and pages_on_node(0, 10) == {}
    del buf
    region.close()


def test_park_bench_script_help():
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "park.py"), "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0 and "--gib" in proc.stdout
    assert Path(PARK).is_file()


def test_failed_copy_or_vote_leaves_everything_as_it_was(one, monkeypatch):
    from tray.errors import DeviceError, HandshakeError

    r, p = one
    s = p.lease(4)
    pool = p.pool()
    real_copy = r.backend.copy

    def broken(*args, **kwargs):
        raise DeviceError("cuMemcpyAsync(...): CUDA_ERROR_ILLEGAL_ADDRESS")

    monkeypatch.setattr(r.backend, "copy", broken)
    with pytest.raises(
        DeviceError,
        match=r"park: the copy failed on rank 0 \(DeviceError: cuMemcpyAsync.*\); "
        "the session stays live on the device on every rank",
    ):
        p.park(s)
    assert s.live and s.dirty == (0, 1, 2, 3) and pool.host_pages.free_count == 8
    monkeypatch.setattr(r.backend, "copy", real_copy)
    parked = p.park(s)
    monkeypatch.setattr(r.backend, "copy", broken)
    with pytest.raises(DeviceError, match="the session stays parked on every rank"):
        p.wake(parked)
    assert parked.parked and pool.device_pages.free_count == 16
    monkeypatch.setattr(r.backend, "copy", real_copy)

    # the head never answers the landed vote: the lease goes back, the session stays parked
    calls = {"n": 0}

    def flaky(topic, value, timeout_s=60.0):
        calls["n"] += 1
        if calls["n"] == 2:
            raise HandshakeError("rank 0: no decision on 'tray.park' from the head within 60.0 s")
        return [value]

    monkeypatch.setattr(r, "exchange", flaky)
    with pytest.raises(HandshakeError):
        p.wake(parked)
    assert parked.parked and pool.device_pages.free_count == 16
    s = p.wake(parked)
    assert s.live and p.stats.parks == 1 and p.stats.wakes == 1
