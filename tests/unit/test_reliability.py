"""In-process checks of the launcher's and the rank's safety rails: vote sizes, sealed memfds, the
manifest loader's cost on hostile files, the head's phase bookkeeping, job dir locks."""

from __future__ import annotations

import fcntl
import json
import os
import stat as stat_mod
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tray.backend.base import ExportedHandle
from tray.backend.host import HostBackend, check_memfd
from tray.errors import HandshakeError, ManifestError
from tray.handshake import wire
from tray.launch.head import Head
from tray.launch.jobdir import SetupError, make_job_dir, open_root, sweep_stale
from tray.launch.spec import RankProcess
from tray.manifest import load_manifest

TOKEN = "t" * 32


@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 64])
def test_votes_within_the_limit_always_make_a_decision_that_fits(world_size):
    limit = wire.vote_limit_nbytes(world_size)
    topic = "a-topic"
    overhead = len(wire.encode(wire.Vote(token=TOKEN, rank=world_size - 1, topic=topic, round=1, value=b"")))
    value = b"x" * (limit - overhead - 4)  # 4 B: bin32 header instead of bin8
    vote = wire.encode(wire.Vote(token=TOKEN, rank=world_size - 1, topic=topic, round=1, value=value))
    assert len(vote) <= limit
    decision = wire.Decision(token=TOKEN, topic=topic, round=1, values=(value,) * world_size)
    assert len(wire.encode(decision)) <= wire.MAX_MESSAGE_NBYTES


def test_memfds_are_sealed_and_checked_on_import():
    backend = HostBackend.open(0)
    try:
        buf = backend.allocate("x", 10_000, True)
        with pytest.raises(PermissionError):
            os.ftruncate(buf.fd, 4096)  # F_SEAL_SHRINK
        check_memfd(buf.fd, buf.mapped_nbytes)
        small = os.memfd_create("small", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(small, 4096)
        with pytest.raises(HandshakeError, match="holds 4096 B, the offer says 12288 B"):
            backend.import_peer(ExportedHandle(kind="memfd", nbytes=12288, fd=os.dup(small)))
        with pytest.raises(HandshakeError, match="not sealed against shrinking"):
            backend.import_peer(ExportedHandle(kind="memfd", nbytes=4096, fd=small))
        mapping = backend.import_peer(ExportedHandle(kind="memfd", nbytes=buf.mapped_nbytes, fd=os.dup(buf.fd)))
        assert mapping.ptr
    finally:
        backend.close()


HOSTILE_MANIFESTS = {
    "long unknown key": {"format": 1, "name": "m", "k" * 5_000_000: 1},
    "long key over a long list": {"format": 1, "name": "m", "buffers": [
        {"name": "b", "dtype": "f32", "shape": [1], "z" * 2_500_000: [1] * 850_000}]},
    "long value": {"format": 1, "name": "m", "buffers": [{"name": "b", "dtype": "f" * 5_000_000, "shape": [1]}]},
    "long description": {"format": 1, "name": "m", "description": "d" * 5_000_000},
}


@pytest.mark.parametrize("case", sorted(HOSTILE_MANIFESTS))
def test_manifest_loader_is_linear_and_cuts_long_text(tmp_path, case):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(HOSTILE_MANIFESTS[case]))
    assert path.stat().st_size >= 5_000_000
    t0 = time.perf_counter()
    try:
        load_manifest(path)
        message = ""
    except ManifestError as exc:
        message = str(exc)
    assert time.perf_counter() - t0 < 1.0
    assert len(message) < 400, message[:400]
    if case == "long unknown key":
        assert '$["kkkk' in message and 'kkk..."]: unknown key' in message


def rank_process(phase: str = "spawn") -> RankProcess:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return RankProcess(rank=0, popen=proc, t_spawn=0.0, phase=phase)


def test_a_late_heartbeat_never_moves_a_rank_back():
    p = rank_process()
    Head._note_phase(p, "allocate")
    Head._note_phase(p, "table")     # the offer arrived
    Head._note_phase(p, "offer")     # a heartbeat sent before it
    assert p.phase == "table"
    Head._note_phase(p, "run")
    Head._note_phase(p, "park")      # after go, phases come and go
    Head._note_phase(p, "run")
    assert p.phase == "run"
    Head._note_phase(p, "bye", force=True)
    Head._note_phase(p, "run")
    assert p.phase == "bye"


def test_job_dir_is_locked_and_swept_only_when_free(tmp_path):
    root = tmp_path / "jobs"
    job = make_job_dir(4, root)
    try:
        assert job.path.parent == root and oct(job.path.stat().st_mode & 0o777) == "0o700"
        other = os.open(job.path / "head.lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(other)
        _, root_fd = open_root(root)
        assert sweep_stale(root_fd) == [] and job.path.is_dir()
        os.close(job.lock_fd)  # the head died
        job.lock_fd = os.open(os.devnull, os.O_RDONLY)
        assert sweep_stale(root_fd) == [job.path.name] and not job.path.exists()
        os.close(root_fd)
    finally:
        job.close()
    assert os.listdir(root) == []


def test_jobs_root_swapped_for_a_link_is_refused(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    root = tmp_path / "jobs"
    root.symlink_to(target)
    with pytest.raises(SetupError, match="is a symbolic link"):
        make_job_dir(1, root)
    assert list(Path(target).iterdir()) == []


def test_a_port_lock_held_a_moment_by_a_sweep_is_taken_but_a_trays_hold_refuses(tmp_path):
    """Another tray's sweep locks a stale `port-P.lock` for the moment it takes to remove it: a tray asking for P
    just then was refused as if a tray held P. A lock held that briefly is now waited for; one held on is a tray's."""
    import errno

    from tray.launch import ports
    from tray.launch.ports import _lock_port

    root_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sweep = os.open("port-4321.lock", os.O_RDWR | os.O_CREAT, 0o600, dir_fd=root_fd)
        fcntl.flock(sweep, fcntl.LOCK_EX)
        sleeps = []

        def sweep_done(s: float) -> None:  # the sweep lets go during the first short wait (no timing to race)
            if not sleeps:
                os.close(sweep)
            sleeps.append(s)

        ports.time.sleep, real_sleep = sweep_done, ports.time.sleep  # type: ignore[assignment]
        try:
            fd = _lock_port(root_fd, 4321)
        finally:
            ports.time.sleep = real_sleep  # type: ignore[assignment]
        assert sleeps == [0.005]
        assert os.pread(fd, 32, 0).decode() == str(os.getpid())
        with pytest.raises(OSError) as refused:  # held on, by the tray that just took it
            _lock_port(root_fd, 4321)
        assert refused.value.errno == errno.EADDRINUSE and f"head pid {os.getpid()}" in str(refused.value)
        os.close(fd)
    finally:
        os.close(root_fd)


def test_a_jobs_root_under_a_directory_others_may_change_is_refused(tmp_path):
    """Only the jobs root itself was checked: under a directory another user may write in (or owns), they could
    move it aside and put their own in its place, where the ranks would send their token to a head of theirs."""
    shared = tmp_path / "shared"
    (shared / "sub").mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.raises(SetupError, match=r"lies under .*/shared \(mode 0777: anyone may write in it\), where another "
                                         "user could move it"):
        open_root(shared / "sub" / "jobs")
    shared.chmod(0o1777)  # sticky, as /tmp: nobody moves another's entries
    path, fd = open_root(shared / "sub" / "jobs")
    os.close(fd)
    if os.getuid() == 0:
        shared.chmod(0o755)
        os.chown(shared, 65534, 65534)
        with pytest.raises(SetupError, match=r"lies under .*/shared \(owned by uid 65534\)"):
            open_root(shared / "sub" / "jobs2")


def test_umask_002_and_a_user_private_group_are_not_taken_for_others(tmp_path, monkeypatch):
    """Under umask 002 (user-private groups: Debian, Fedora) the directories tray makes itself were group-writable
    and then refused by its own check; a group-writable directory of this user's own group is not another user's.
    One whose group is another group is; and with a /tmp others may change, the default root moves to the home."""
    from tray.launch import jobdir

    old = os.umask(0o002)
    try:
        path, fd = open_root(tmp_path / "a" / "b" / "jobs")
        os.close(fd)
    finally:
        os.umask(old)
    assert all(stat_mod.S_IMODE((tmp_path / p).stat().st_mode) == 0o700 for p in ("a", "a/b", "a/b/jobs"))
    shared = tmp_path / "mine"
    shared.mkdir()
    shared.chmod(0o775)
    os.chown(shared, os.getuid(), os.getgid())
    if jobdir.private_group(os.getgid()):  # this user's own group (root's here; a user's under UPG)
        assert jobdir.others_may_change(shared.stat()) is None
    if os.getuid() == 0:
        os.chown(shared, 0, 65534)
        assert "its group (gid 65534) may write in it" in (jobdir.others_may_change(shared.stat()) or "")
    unsafe_tmp = tmp_path / "tmp"
    unsafe_tmp.mkdir()
    unsafe_tmp.chmod(0o777)
    monkeypatch.delenv("TRAY_JOBS_ROOT", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(unsafe_tmp))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(jobdir.tempfile, "tempdir", None)
    assert jobdir.default_root() == unsafe_tmp / f"tray-{os.getuid()}"   # no such home: the error names the tmp
    (tmp_path / "home").mkdir(mode=0o700)
    assert jobdir.default_root() == tmp_path / "home" / ".cache" / "tray-jobs"


def test_a_jobs_root_reached_through_another_users_link_is_refused(tmp_path):
    """The directories above the jobs root were checked with its links resolved, so a root reached through a link of
    another user passed: its owner could point the link at a directory of theirs while the tray starts, and the ranks,
    which reach the job dir by its path, would send their token to a head of theirs (and write their error files
    through links planted there). Every link on the way must be this user's or root's, in a directory others cannot
    change."""
    from tray.launch import jobdir

    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(mine)
    path, fd = open_root(link / "jobs")  # a link of this user's: fine
    os.close(fd)
    chained = tmp_path / "chained"
    chained.symlink_to("link")  # a link whose target is another link
    assert [entry[0] for entry in jobdir._links_on_the_way(str(chained / "jobs"))] == [str(chained), str(link)]
    if os.getuid() != 0:
        pytest.skip("needs root to give a link to another user")
    os.lchown(link, 65534, 65534)
    for root in (link / "jobs", chained / "jobs"):
        # in a directory only this user may write in, no one can point the link elsewhere, its owner neither (a link's
        # target never changes: it is removed and made again): an admin's link to a home, say
        path, fd = open_root(root)
        os.close(fd)
    os.lchown(link, os.getuid(), os.getgid())
    sticky = tmp_path / "sticky"
    sticky.mkdir(mode=0o700)
    sticky.chmod(0o1777)  # as /tmp: there a link's owner may remove it and put another
    (sticky / "link").symlink_to(mine)
    os.lchown(sticky / "link", 65534, 65534)
    with pytest.raises(SetupError, match=rf"lies under the link {sticky / 'link'} \(owned by uid 65534\)"):
        open_root(sticky / "link" / "jobs")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o777)  # others may replace a link of this user's in it
    (shared / "link").symlink_to(mine)
    with pytest.raises(SetupError, match=r"lies under the link .*/shared/link, in .*/shared \(mode 0777"):
        open_root(shared / "link" / "jobs")


def _default_root_between(tmp_path, monkeypatch, tmp_mode: int):
    """No TRAY_JOBS_ROOT nor XDG_RUNTIME_DIR; TMPDIR a fresh `tmp` of `tmp_mode` (returned), HOME a fresh 0700 home."""
    from tray.launch import jobdir

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(tmp_mode)
    (tmp_path / "home").mkdir(mode=0o700)
    monkeypatch.delenv("TRAY_JOBS_ROOT", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(jobdir.tempfile, "tempdir", None)
    return tmp


def test_a_default_root_name_taken_by_another_user_falls_back_to_the_home(tmp_path, monkeypatch):
    """Any user may make $TMPDIR/tray-<uid> for any uid first (a link, a dir of theirs), and this user cannot remove
    it from a sticky /tmp: every launch then failed with a SetupError. The default root moves to the home instead."""
    from tray.launch import jobdir

    tmp = _default_root_between(tmp_path, monkeypatch, 0o1777)
    squat = tmp / f"tray-{os.getuid()}"
    assert jobdir.default_root() == squat  # free: the tmp
    squat.symlink_to(tmp_path / "elsewhere")
    assert jobdir.default_root() == tmp_path / "home" / ".cache" / "tray-jobs"
    squat.unlink()
    squat.mkdir(mode=0o700)
    assert jobdir.default_root() == squat  # this user's own, from an earlier launch
    if os.getuid() == 0:
        os.chown(squat, 65534, 65534)
        assert jobdir.default_root() == tmp_path / "home" / ".cache" / "tray-jobs"
    path, fd = open_root(jobdir.default_root())
    os.close(fd)


def test_a_link_below_a_directory_another_user_may_change_is_refused(tmp_path):
    """A link of this user's, in a directory of this user's, is only as safe as the directories above that one: their
    owner can move the link's directory aside and put one of theirs, with a link of theirs, in its place. With the link
    resolved, those directories are not on the path the checks walked. And `link/..` is the link's target's parent, as
    the kernel resolves it, not the link's own directory."""
    mine = tmp_path / "mine"
    (mine / "a" / "b").mkdir(parents=True, mode=0o700)
    theirs = tmp_path / "theirs"
    (theirs / "inner").mkdir(parents=True, mode=0o755)
    (theirs / "inner" / "link").symlink_to(mine)
    (theirs / "evil").symlink_to(mine / "a" / "b")
    for root in (theirs / "inner" / "link" / "jobs", theirs / "evil" / ".." / "jobs"):
        path, fd = open_root(root)  # every directory on the way is this user's or root's: fine
        os.close(fd)
    if os.getuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    os.chown(theirs, 65534, 65534)
    with pytest.raises(SetupError, match=rf"lies under the link {theirs / 'inner' / 'link'}, in {theirs / 'inner'}, "
                                         rf"under {theirs} \(owned by uid 65534\)"):
        open_root(theirs / "inner" / "link" / "jobs")
    with pytest.raises(SetupError, match=rf"lies under the link {theirs / 'evil'}, in {theirs} \(owned by uid 65534\)"):
        open_root(theirs / "evil" / ".." / "jobs")


def test_a_jobs_root_that_cannot_be_made_says_why_not_to_remove_it_and_why_the_tmp_was_not_taken(tmp_path, monkeypatch):
    """The home's jobs root, taken because the temporary directory may be changed by others, cannot be made: the
    error said to remove what does not exist, and not why the temporary directory was passed over."""
    from tray.launch import jobdir

    unsafe_tmp = _default_root_between(tmp_path, monkeypatch, 0o777)
    real_mkdir = os.mkdir

    def mkdir(path, mode=0o777, **kw):
        if str(path).endswith("tray-jobs"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_mkdir(path, mode, **kw)

    monkeypatch.setattr(jobdir.os, "mkdir", mkdir)
    with pytest.raises(SetupError) as info:
        open_root()
    said = str(info.value)
    assert f"cannot create the jobs root {tmp_path / 'home' / '.cache' / 'tray-jobs'}: Permission denied; set " \
           "TRAY_JOBS_ROOT to a directory of your own (0700) (the temporary directory's was not taken: " \
           f"{unsafe_tmp / f'tray-{os.getuid()}'}" in said, said
    assert "remove it" not in said, said


def test_a_jobs_root_the_user_named_is_never_advised_removed(tmp_path, monkeypatch):
    """TRAY_JOBS_ROOT=/tmp as a user other than its owner: refused, rightly, with "remove it or set TRAY_JOBS_ROOT",
    advice to remove a shared directory. A root the user named gets only "set TRAY_JOBS_ROOT"; tray's own default
    (a stale one of its own making) may still be removed."""
    if os.getuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    theirs = tmp_path / "shared"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    monkeypatch.setenv("TRAY_JOBS_ROOT", str(theirs))
    with pytest.raises(SetupError, match=r"is owned by uid 65534, not by this user .*; set TRAY_JOBS_ROOT to a "
                                         r"directory of your own \(a new path") as caught:
        open_root()
    assert "remove it" not in str(caught.value)
