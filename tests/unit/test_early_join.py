"""The NCCL join made while ranks start (tray/collectives/early.py): the head's plan and ids file, the rank's
thread, and how the collectives take (or refuse) what it joined. NCCL itself is faked here; the real join
runs in tests/gpu/test_tray_cuda.py."""

from __future__ import annotations

import itertools
import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from tray.backend.base import GroupInfo
from tray.collectives import early
from tray.collectives.base import UNIQUE_ID_NBYTES, GroupJoin
from tray.errors import DeviceError, HandshakeError, UsageError
from tray.manifest import parse_manifest
from tray.rank.phases import PhaseClock
from tray.rank.wiring import LazyCollectives


def _resolved(n: int = 4, collective: bool = False):
    doc: dict = {"format": 1, "name": "m", "groups": [{"name": "world", "ranks": "all"}, {"name": "pairs", "size": 2}],
                 "buffers": [{"name": "x", "dtype": "f32", "shape": [4]}, {"name": "y", "dtype": "f32", "shape": [4]}]}
    if collective:
        doc["programs"] = [{"name": "sum", "ops": [{"op": "nccl", "collective": "allreduce", "group": "world",
                                                    "send": "x", "recv": "y", "count": 4, "dtype": "f32"}]}]
    return parse_manifest(doc, "<test>", ".").resolve(n)


def _ids():
    counter = itertools.count()
    return lambda: next(counter).to_bytes(2, "little") * 64


def test_plan_gives_one_id_per_group_instance_shared_by_its_members() -> None:
    plans = early.plan(_resolved(4), range(4), _ids())
    assert sorted(plans) == [0, 1, 2, 3]
    by_instance: dict[tuple[str, tuple[int, ...]], set[bytes]] = {}
    for rank, entries in plans.items():
        assert [e.group for e in entries] == ["world", "pairs"]
        for e in entries:
            assert e.members[e.index] == rank and len(e.uid) == 128
            by_instance.setdefault((e.group, e.members), set()).add(e.uid)
    assert sorted(by_instance) == [("pairs", (0, 1)), ("pairs", (2, 3)), ("world", (0, 1, 2, 3))]
    assert all(len(uids) == 1 for uids in by_instance.values())  # one id per instance...
    assert len({u for uids in by_instance.values() for u in uids}) == 3  # ...and a fresh one for each


@pytest.mark.parametrize(("mode", "backend", "collective", "want"), [
    ("auto", "cuda", True, True), ("auto", "cuda", False, False), ("early", "cuda", False, True),
    ("lazy", "cuda", True, False), ("early", "host", True, False), ("auto", "host", True, False)])
def test_which_trays_join_early(mode: str, backend: str, collective: bool, want: bool) -> None:
    assert early.wanted(mode, backend, _resolved(2, collective)) is want


def test_an_unknown_mode_is_a_usage_error_naming_the_choices() -> None:
    with pytest.raises(UsageError, match="auto, early, lazy, got 'soon'"):
        early.wanted("soon", "cuda", _resolved(2))


def test_the_flag_wins_over_the_environment_and_both_are_checked(tmp_path: Path, monkeypatch) -> None:
    from tray.envvars import join_collectives

    assert join_collectives(None, None) == "auto" and join_collectives(None, "") == "auto"
    assert join_collectives(None, "lazy") == "lazy" and join_collectives("early", "lazy") == "early"
    with pytest.raises(UsageError, match="TRAY_JOIN_COLLECTIVES must be one of auto, early, lazy, got 'never'"):
        join_collectives(None, "never")
    with pytest.raises(UsageError, match="--join-collectives must be one of"):
        join_collectives("x", None)
    monkeypatch.setenv("TRAY_JOIN_COLLECTIVES", "lazy")
    assert not _head(tmp_path, "cuda", None).start_join.wanted  # a bench's tray: no flag, the environment decides
    assert _head(tmp_path, "cuda", "early").start_join.wanted
    monkeypatch.setenv("TRAY_JOIN_COLLECTIVES", "early")
    assert _head(tmp_path, "cuda", None, collective=False).start_join.wanted


def test_ids_file_round_trip_private_and_written_whole(tmp_path: Path) -> None:
    path = tmp_path / early.IDS_FILE
    plans = early.plan(_resolved(4), range(4), _ids())
    early.write_ids(path, plans)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not list(tmp_path.glob("*.tmp"))
    for rank in range(4):
        assert early.read_ids(str(path), rank, 1.0) == (plans[rank], "", 0.0)
    with pytest.raises(HandshakeError, match="no valid entries for rank 7"):
        early.read_ids(str(path), 7, 1.0)
    early.write_ids(path, None, error="no NCCL here", made_s=0.25)
    assert early.read_ids(str(path), 0, 1.0) == (None, "no NCCL here", 0.25)


def test_the_ids_file_is_never_written_through_what_sits_at_its_temporary_name(tmp_path: Path) -> None:
    """A link at the temporary name (to a file of the user's) was followed: that file was truncated and overwritten."""
    path = tmp_path / early.IDS_FILE
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    path.with_name(path.name + ".tmp").symlink_to(precious)
    early.write_ids(path, early.plan(_resolved(2), range(2), _ids()))
    assert precious.read_text() == "keep me" and not path.is_symlink()
    assert early.read_ids(str(path), 1, 1.0)[0] is not None


def test_a_rank_waits_for_the_ids_and_names_the_file_when_they_never_come(tmp_path: Path) -> None:
    path = tmp_path / early.IDS_FILE
    plans = early.plan(_resolved(2), range(2), _ids())
    threading.Timer(0.1, early.write_ids, (path, plans)).start()
    t0 = time.monotonic()
    assert early.read_ids(str(path), 1, 5.0)[0] == plans[1]
    assert 0.09 < time.monotonic() - t0 < 2.0
    with pytest.raises(HandshakeError, match=r"did not write the NCCL ids \(.*missing.json\) within 0.2 s"):
        early.read_ids(str(tmp_path / "missing.json"), 0, 0.2)


class _Comm:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = self.aborted = False
        self.stream = 0

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True


class _FakeJoin:
    """Stands in for NCCL: records what it joined; optionally blocks until `go` or fails."""

    def __init__(self, fail: bool = False, block: bool = False) -> None:
        self.fail = fail
        self.go = threading.Event()
        if not block:
            self.go.set()
        self.released = 0
        self.joined: list[early.Entry] = []

    def __call__(self, entries, ordinal, steps):
        self.go.wait(10)
        steps["init"] = 0.0
        if self.fail:
            raise DeviceError("ncclCommInitRank failed: fake")
        self.joined = list(entries)
        return {e.group: _Comm(e.group) for e in entries}, self._release

    def _release(self) -> None:
        self.released += 1


def _early(tmp_path: Path, rank: int, join: _FakeJoin, n: int = 2) -> early.EarlyJoin:
    path = tmp_path / early.IDS_FILE
    if not path.exists():
        early.write_ids(path, early.plan(_resolved(n), range(n), _ids()))
    ej = early.EarlyJoin(str(path), rank, ordinal=rank, timeout_s=5.0, join=join)
    ej.begin()
    return ej


def test_take_hands_over_what_was_joined_once(tmp_path: Path) -> None:
    join = _FakeJoin()
    ej = _early(tmp_path, 1, join)
    groups = ej.take(5.0)
    assert groups is not None and sorted(groups) == ["pairs", "world"]
    assert ej.seconds is not None and ej.waited_s is not None and ej.mismatch(
        [GroupInfo("world", (0, 1), 1), GroupInfo("pairs", (0, 1), 1)]) == ""
    assert ej.mismatch([GroupInfo("world", (0, 1), 1)]) == (
        "the head planned pairs [0, 1] as member 1; this rank's manifest gives none")
    with pytest.raises(UsageError, match="twice"):
        ej.take(1.0)
    ej.release()
    ej.release()
    assert join.released == 1


def test_a_failed_join_is_raised_where_the_collectives_are_first_used(tmp_path: Path) -> None:
    ej = _early(tmp_path, 0, _FakeJoin(fail=True))
    with pytest.raises(DeviceError, match="ncclCommInitRank failed: fake"):
        ej.take(5.0)


def test_a_join_that_never_ends_is_named_not_waited_for_forever(tmp_path: Path) -> None:
    join = _FakeJoin(block=True)
    ej = _early(tmp_path, 0, join)
    with pytest.raises(DeviceError, match=r"rank 0: the NCCL join started with the rank did not finish within 0.2 s "
                                          r"of its first collective; its thread is in ncclCommInitRank for world "
                                          r"\(ranks 0, 1\), pairs \(ranks 0, 1\)"):
        ej.take(0.2)
    join.go.set()


def test_leftovers_at_close_and_nothing_when_the_join_is_still_running(tmp_path: Path) -> None:
    ej = _early(tmp_path, 0, _FakeJoin())
    left = ej.leftovers(5.0)
    assert sorted(left) == ["pairs", "world"]
    assert ej.leftovers(5.0) == {}
    join = _FakeJoin(block=True)
    (tmp_path / early.IDS_FILE).unlink()
    ej = _early(tmp_path, 1, join)
    assert ej.leftovers(0.05) == {}
    join.go.set()


def test_the_join_waits_for_begin_and_a_cancelled_one_never_joins(tmp_path: Path) -> None:
    early.write_ids(tmp_path / early.IDS_FILE, early.plan(_resolved(2), range(2), _ids()))
    join = _FakeJoin()
    ej = early.EarlyJoin(str(tmp_path / early.IDS_FILE), 0, 0, timeout_s=5.0, join=join)
    time.sleep(0.1)
    assert not ej.done and join.joined == [] and ej.steps == {}  # nothing before begin(), not even the file
    ej.begin()
    assert sorted(ej.take(5.0) or {}) == ["pairs", "world"] and ej.steps["begin"] >= 0.1
    join = _FakeJoin()
    ej = early.EarlyJoin(str(tmp_path / early.IDS_FILE), 1, 1, timeout_s=5.0, join=join)
    ej.cancel()
    assert ej.take(5.0) is None and join.joined == []


def test_from_environ_only_for_cuda_ranks_the_head_made_ids_for(tmp_path: Path) -> None:
    ids = str(tmp_path / early.IDS_FILE)
    assert early.from_environ(0, 0, 1.0, {"TRAY_BACKEND": "cuda", "TRAY_JOB": str(tmp_path)}) is None
    host = {"TRAY_BACKEND": "host", "TRAY_JOB": str(tmp_path), early.IDS_ENV: ids}
    assert early.from_environ(0, 0, 1.0, host) is None
    # a file outside this rank's job dir is another tray's (a stray variable): no early join
    assert early.from_environ(0, 0, 1.0, {"TRAY_BACKEND": "cuda", "TRAY_JOB": "/elsewhere", early.IDS_ENV: ids}) is None
    ej = early.from_environ(0, 0, 1.0, {"TRAY_BACKEND": "cuda", "TRAY_JOB": str(tmp_path), early.IDS_ENV: ids})
    assert ej is not None
    ej.cancel()


# --- the collectives taking the early join ----------------------------------------------------------------


class _Joiner:
    def __init__(self) -> None:
        self.lazy_joins: list[list[GroupJoin]] = []

    def join_info(self, group: GroupInfo) -> bytes:
        return b"lazy-id"

    def join(self, joins):
        self.lazy_joins.append(list(joins))
        return {j.group.name: _Comm(j.group.name) for j in joins}

    def adopt(self, joins, joined):
        for c in joined.values():
            c.stream = 77
        return dict(joined)


def _pending(rank: int, n: int = 2) -> list[GroupJoin]:
    members = tuple(range(n))
    return [GroupJoin(GroupInfo("world", members, rank), b"", barrier=None),  # type: ignore[arg-type]
            GroupJoin(GroupInfo("pairs", (0, 1), rank), b"", barrier=None)]  # type: ignore[arg-type]


def _no_exchange(topic, value, timeout_s):
    raise AssertionError("an early join makes no tray-wide step")


def test_first_use_takes_the_early_join_without_a_tray_wide_step(tmp_path: Path) -> None:
    join = _FakeJoin()
    joiner = _Joiner()
    clock = PhaseClock()
    coll = LazyCollectives(joiner, _pending(1), clock, early=_early(tmp_path, 1, join))  # type: ignore[arg-type]
    world = coll.of("world", _no_exchange)
    assert world.stream == 77 and coll.of("pairs", _no_exchange).name == "pairs"
    assert joiner.lazy_joins == [] and {"collectives", "nccl_early", "nccl_early.ids", "nccl_early.init"} <= set(
        clock.timings)
    coll.close()
    assert world.closed and join.released == 1


def test_groups_other_than_the_manifests_are_a_named_error_and_are_aborted(tmp_path: Path) -> None:
    join = _FakeJoin()
    joiner = _Joiner()
    early.write_ids(tmp_path / early.IDS_FILE, early.plan(_resolved(4), range(4), _ids()))  # the head planned 4
    ej, groups = _joined(tmp_path, 0, join)
    coll = LazyCollectives(joiner, _pending(0, n=2), PhaseClock(), early=ej)  # type: ignore[arg-type]  # manifest: 2
    with pytest.raises(DeviceError, match=r"not this rank's: the head planned world \[0, 1, 2, 3\] as member 0; "
                                          r"this rank's manifest gives world \[0, 1\] as member 0"):
        coll.of("world", _no_exchange)  # no lazy join on one rank alone: the others would wait for it
    assert joiner.lazy_joins == [] and all(c.aborted for c in groups.values()) and join.released == 1
    coll.close()


def test_a_failed_join_fails_every_later_use_the_same_way(tmp_path: Path) -> None:
    coll = LazyCollectives(_Joiner(), _pending(0), PhaseClock(),  # type: ignore[arg-type]
                           early=_early(tmp_path, 0, _FakeJoin(fail=True)))
    for _ in range(2):
        with pytest.raises(DeviceError, match="ncclCommInitRank failed: fake"):
            coll.of("world", _no_exchange)
    coll.close()


def _joined(tmp_path: Path, rank: int, join: _FakeJoin) -> tuple[early.EarlyJoin, dict]:
    """An early join run to its end, and the communicators it made."""
    ej = _early(tmp_path, rank, join)
    while not ej.done:
        time.sleep(0.01)
    return ej, dict(ej._groups or {})


def _rank_env():
    from tray.rank.env import RankEnv

    return RankEnv(rank=0, world_size=2, local_rank=0, device=0, endpoint="", job_dir="", token="t", manifest="",
                   backend="cuda", vars=(), t_spawn=None)


def test_a_start_that_fails_after_the_collectives_exist_aborts_without_waiting(tmp_path: Path) -> None:
    from tray.rank.wiring import Parts

    join = _FakeJoin()
    ej, groups = _joined(tmp_path, 0, join)
    env = _rank_env()
    coll = LazyCollectives(_Joiner(), _pending(0), PhaseClock(), early=ej)  # type: ignore[arg-type]
    Parts(env, PhaseClock(), collectives=coll, early=ej).close()
    assert all(c.aborted and not c.closed for c in groups.values()) and join.released == 1
    blocked = _FakeJoin(block=True)
    (tmp_path / early.IDS_FILE).unlink()
    ej = _early(tmp_path, 1, blocked)
    coll = LazyCollectives(_Joiner(), _pending(1), PhaseClock(), early=ej)  # type: ignore[arg-type]
    t0 = time.monotonic()
    Parts(env, PhaseClock(), collectives=coll, early=ej).close()  # the join still runs: not waited for
    assert time.monotonic() - t0 < 1.0
    blocked.go.set()


def test_a_start_that_fails_while_the_join_waits_for_the_ids_never_joins(tmp_path: Path) -> None:
    """The rank's start failed after begin(), while the join's thread still waited for the head's ids: the close
    could not stop it, and once the file came the thread joined NCCL for a tray that had failed (a communicator,
    the device's context held, and a thread waiting in ncclCommInitRank for members that never come). A join
    cancelled before it began never begins."""
    from tray.rank.wiring import Parts

    path = tmp_path / early.IDS_FILE
    join = _FakeJoin()
    ej = early.EarlyJoin(str(path), 0, 0, timeout_s=5.0, join=join)
    ej.begin()
    time.sleep(0.05)  # the thread polls for the ids file
    Parts(_rank_env(), PhaseClock(), early=ej).close()
    early.write_ids(path, early.plan(_resolved(2), range(2), _ids()))
    deadline = time.monotonic() + 5.0
    while not ej.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ej.done and join.joined == [] and ej._release is None


def test_no_ids_from_the_head_means_the_lazy_join(tmp_path: Path) -> None:
    early.write_ids(tmp_path / early.IDS_FILE, None, error="no NCCL in the head's Python")
    join = _FakeJoin()
    ej = early.EarlyJoin(str(tmp_path / early.IDS_FILE), 0, 0, timeout_s=5.0, join=join)
    ej.begin()
    joiner = _Joiner()
    coll = LazyCollectives(joiner, _pending(0), PhaseClock(), early=ej)  # type: ignore[arg-type]
    coll.of("world", lambda topic, value, timeout_s: [value, {}])
    assert len(joiner.lazy_joins) == 1 and join.joined == [] and ej.lazy_because == "no NCCL in the head's Python"
    coll.close()


def test_close_without_first_use_closes_what_the_early_join_made(tmp_path: Path) -> None:
    join = _FakeJoin()
    ej, groups = _joined(tmp_path, 0, join)
    coll = LazyCollectives(_Joiner(), _pending(0), PhaseClock(), early=ej)  # type: ignore[arg-type]
    coll.close()
    assert groups and all(c.closed for c in groups.values()) and join.released == 1


def test_a_failed_start_aborts_what_the_early_join_made(tmp_path: Path) -> None:
    from tray.rank.wiring import Parts

    join = _FakeJoin()
    ej, groups = _joined(tmp_path, 0, join)
    Parts(_rank_env(), PhaseClock(), early=ej).close()
    assert all(c.aborted and not c.closed for c in groups.values()) and join.released == 1


# --- the head ------------------------------------------------------------------------------------------------


def _head(tmp_path: Path, backend: str, mode: str | None, collective: bool = True):
    from tray.launch.head import Head
    from tray.launch.spec import TraySpec

    manifest = tmp_path / "m.json"
    doc = {"format": 1, "name": "m", "groups": [{"name": "world", "ranks": "all"}],
           "buffers": [{"name": "x", "dtype": "f32", "shape": [4]}, {"name": "y", "dtype": "f32", "shape": [4]}]}
    if collective:
        doc["programs"] = [{"name": "sum", "ops": [{"op": "nccl", "collective": "allreduce", "group": "world",
                                                    "send": "x", "recv": "y", "count": 4, "dtype": "f32"}]}]
    manifest.write_text(json.dumps(doc))
    return Head(TraySpec(nprocs=2, cmd=("true",), backend=backend, manifest=str(manifest), join_collectives=mode))


class _FakeIdMaker:
    def __init__(self, ids=None, error: str = "") -> None:
        self.t_start = time.perf_counter()
        self.ids, self.error = ids, error

    def answer(self) -> list[bytes]:
        if self.error:
            raise DeviceError(self.error)
        return self.ids


def test_the_head_writes_every_ranks_ids_or_why_it_could_not(tmp_path: Path) -> None:
    head = _head(tmp_path, "cuda", "auto")
    assert head.start_join.wanted and not _head(tmp_path, "cuda", "lazy").start_join.wanted
    assert not _head(tmp_path, "host", "early").start_join.wanted
    assert not _head(tmp_path, "cuda", "auto", False).start_join.wanted
    assert early.instance_count(head.resolved, range(2)) == 1
    join = head.start_join
    join._maker = _FakeIdMaker([b"\x07" * 128])  # type: ignore[assignment]
    path = tmp_path / early.IDS_FILE
    join.write(tmp_path, print)
    assert [early.read_ids(str(path), r, 1.0)[0][0].members for r in (0, 1)] == [(0, 1), (0, 1)]
    assert early.read_ids(str(path), 1, 1.0)[0][0].uid == b"\x07" * 128
    assert join.made_s is not None and early.read_ids(str(path), 0, 1.0)[2] == join.made_s
    join._maker = _FakeIdMaker(error="no libnccl and no nccl4py")  # type: ignore[assignment]  # NCCL could not
    join.write(tmp_path, print)
    assert early.read_ids(str(path), 0, 1.0)[:2] == (None, "the head could not make NCCL ids: "
                                                      "no libnccl and no nccl4py")
    join = _head(tmp_path, "cuda", "auto").start_join
    join.error = "the head could not start its NCCL id process (/x/python): No such file"
    join.write(tmp_path, print)  # no id process at all
    assert early.read_ids(str(path), 1, 1.0)[:2] == (None, join.error)


def test_plan_asks_one_id_per_instance_as_instance_count_says() -> None:
    resolved = _resolved(4)
    made = []
    early.plan(resolved, range(4), lambda: made.append(1) or bytes(128))
    assert len(made) == early.instance_count(resolved, range(4)) == 3  # world, and two pairs
    assert early.instance_count(resolved, [2, 3]) == 2


# --- the head's id process (tray/collectives/idmaker.py) -------------------------------------------------------


def _id_maker_or_skip(count: int, pgid: int):
    """An id process and its ids; skips where this Python finds no libnccl (cuda.pathfinder, the `gpu` extra)."""
    from tray.collectives.idmaker import IdMaker, unique_id_maker

    try:
        unique_id_maker()
    except Exception as exc:
        pytest.skip(f"no libnccl here: {exc!r}")
    maker = IdMaker(count, pgid)
    try:
        return maker, maker.answer(30.0)
    except BaseException:
        maker.close()
        raise


def test_the_id_process_holds_its_roots_until_released_and_lives_in_the_trays_process_group() -> None:
    """Real ids from libnccl (where cuda.pathfinder finds one): the process keeps one NCCL bootstrap root thread
    per id while no member came, stays in the process group it was given (the tray's, which the teardown and
    the watchdog kill), and ends when the head closes its stdin."""
    import subprocess
    import sys

    from tray.launch.watchdog import group_members, kill_group

    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], process_group=0)
    try:
        maker, ids = _id_maker_or_skip(3, leader.pid)
        assert len(ids) == len(set(ids)) == 3 and all(len(u) == UNIQUE_ID_NBYTES for u in ids)
        assert os.getpgid(maker.popen.pid) == leader.pid
        time.sleep(0.2)
        assert maker.popen.poll() is None  # nobody joined: the roots wait, here and not in the head
        assert len(os.listdir(f"/proc/{maker.popen.pid}/task")) == 1 + 3
        t0 = time.monotonic()
        assert maker.close() == 0 and time.monotonic() - t0 < 2.0
        maker, _ = _id_maker_or_skip(1, leader.pid)  # a tray's teardown: its process group killed
        assert kill_group(leader.pid, frozenset()) == []  # (and reaped there: close() has no status left to read)
        assert maker.close() is not None and not os.path.exists(f"/proc/{maker.popen.pid}")
        assert group_members(leader.pid) == []
    finally:
        leader.kill()
        leader.wait(10)


def test_the_id_process_runs_this_tray_whatever_the_working_directory_holds(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "tray").mkdir()
    (tmp_path / "tray" / "__init__.py").write_text("raise ImportError('a tray/ in the working directory')\n")
    monkeypatch.chdir(tmp_path)
    maker, ids = _id_maker_or_skip(1, 0)
    try:
        assert len(ids) == 1
    finally:
        maker.close()


def test_the_id_process_ends_once_its_roots_have_served_their_members() -> None:
    from tray.collectives.idmaker import wait_for_roots

    threads = [4, 4, 3, 2, 1]
    r, w = os.pipe()
    try:
        assert wait_for_roots(1, r, lambda: threads.pop(0), poll_s=0.001) == "served" and threads == []
        os.write(w, b"ignored")
        os.close(w)
        w = -1
        assert wait_for_roots(1, r, lambda: 2, poll_s=0.001) == "released"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


@pytest.mark.parametrize(("code", "says"), [
    ("print('{\"error\": \"ncclGetUniqueId returned ncclResult 2\", \"made_s\": 0.1}')",
     "^ncclGetUniqueId returned ncclResult 2$"),
    ("import sys; sys.exit(3)", r"ended without ids \(exit status 3\)"),
    ("print('{\"ids\": [\"00\"]}')", "gave 1 ids, expected 2"),
    ("print('not json')", "answered b'not json"),
    ("import time; time.sleep(30)", "gave no ids within 0.3 s"),
])
def test_the_heads_wait_for_its_id_process_is_bounded_and_says_why(code: str, says: str) -> None:
    import re
    import subprocess
    import sys

    from tray.collectives.idmaker import IdMaker

    maker = IdMaker.__new__(IdMaker)
    maker.count, maker.t_start = 2, time.perf_counter()
    maker.popen = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        with pytest.raises(DeviceError) as info:
            maker.answer(0.3 if "sleep" in code else 30.0)
        assert re.search(says, str(info.value)), str(info.value)
    finally:
        maker.popen.kill()
        maker.close()


def test_the_id_process_refuses_a_bad_count() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tray.collectives.idmaker", "three"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "COUNT" in out.stderr and out.stdout == ""


def test_the_heads_ids_come_from_libnccl_without_nccl4py_or_cuda() -> None:
    """Where cuda.pathfinder finds a libnccl (the `gpu` extra; this machine may have one without a GPU), the head
    makes real ids through ctypes: 128 bytes each, a fresh one per call, no nccl4py, numpy or driver imported."""
    import subprocess
    import sys

    code = ("import sys\nfrom tray.collectives.idmaker import unique_id_maker\nmake = unique_id_maker()\n"
            "a, b = make(), make()\nassert len(a) == len(b) == 128 and a != b\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('nccl', 'numpy', 'cuda') and "
            "'pathfinder' not in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if "ImportError" in out.stderr or "NotFoundError" in out.stderr:
        pytest.skip(f"no cuda.pathfinder or no libnccl here: {out.stderr.strip().splitlines()[-1]}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("[]", "['cuda']"), out.stdout


def test_the_timeline_says_when_the_ranks_join_early(tmp_path: Path, capsys) -> None:
    import types as _types

    for mode, says in (("early", True), ("lazy", False)):
        head = _head(tmp_path, "cuda", mode)
        head.procs = [_types.SimpleNamespace(rank=r, t_spawn=100.0) for r in range(2)]  # type: ignore[misc]
        head.t_go, head.start_join.made_s = 100.5, 0.0123
        head._print_timeline()
        err = capsys.readouterr().err
        assert "tray up in 0.500 s" in err
        assert ("NCCL: the ranks join their groups on a thread" in err) is says
        assert ("their ids made in 12 ms by the head's id process" in err) is says
    head = _head(tmp_path, "cuda", "early")
    head.procs = [_types.SimpleNamespace(rank=0, t_spawn=100.0)]  # type: ignore[misc]
    head.t_go, head.start_join.error = 100.5, "the head could not make NCCL ids: no libnccl"
    head._print_timeline()
    assert "NCCL: the ranks join at the first collective: the head could not make NCCL ids: no libnccl" in (
        capsys.readouterr().err)


def test_the_ids_path_reaches_the_ranks_of_a_head_that_joins_early(tmp_path: Path, monkeypatch) -> None:
    from tray.launch import head as head_mod

    head = _head(tmp_path, "cuda", "early")
    envs = []
    monkeypatch.setattr(head_mod, "spawn_rank", lambda spec, rank, env, placement, pgid: envs.append(env))
    head._spawn_all(tmp_path, "ipc://x", os.getpgid(0))
    assert [e[early.IDS_ENV] for e in envs] == [str(tmp_path / early.IDS_FILE)] * 2
    head = _head(tmp_path, "cuda", "lazy")
    envs.clear()
    monkeypatch.setenv(early.IDS_ENV, "/tmp/another-tray/nccl-ids.json")  # e.g. a tray launched from a rank
    head._spawn_all(tmp_path, "ipc://x", os.getpgid(0))
    assert len(envs) == 2 and all(early.IDS_ENV not in e for e in envs)


def test_the_real_join_is_imported_lazily() -> None:
    """Importing the module (the head does) loads neither NCCL nor the driver."""
    import subprocess
    import sys

    code = ("import sys, tray.collectives.early; "
            "print([m for m in sys.modules if m.startswith(('nccl', 'cuda', 'tray.backend.cuda', 'numpy'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"



