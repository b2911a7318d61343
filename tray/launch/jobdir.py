"""Private job directories (0700) under a checked per-user root, and sweeping stale ones.

The root is opened without following links and checked through its fd (a directory, owned by this
uid, mode 0700); everything below it is made and removed relative to that fd, so a planted link or a
swapped path cannot steer the head into a directory someone else chose. A job dir is live while its
`head.lock` is flocked: the head holds it for its lifetime (and its watchdog until it has cleaned up),
so liveness holds across pid namespaces, where a pid proves nothing.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tray.errors import SetupError
from tray.launch.shm import remove_recorded_shm
from tray.text import path_text

LOCK_NAME = "head.lock"
# NOTE: sun_path holds 108 bytes with its NUL; ZeroMQ's ipc:// and the fd sockets bind there.
MAX_SOCKET_PATH = 107
# NOTE: a half-made job dir (before its lock exists) lives for microseconds; one older than this
# belongs to a head that died while making it.
HALF_MADE_AGE_S = 60.0
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class JobDir:
    """A live job dir: `path`, its open fd, and the held lock (`lock_fd`). `close()` removes it."""

    path: Path
    root: Path
    root_fd: int
    fd: int
    lock_fd: int

    def close(self) -> None:
        """Remove the job dir (relative to the checked root) and release the lock. Idempotent."""
        if self.fd < 0:
            return
        _remove_entry(self.root_fd, self.path.name)
        for fd in (self.fd, self.lock_fd, self.root_fd):
            os.close(fd)
        self.fd = self.lock_fd = self.root_fd = -1


def default_root() -> Path:
    """$TRAY_JOBS_ROOT; else $XDG_RUNTIME_DIR/tray when that dir is ours and 0700; else $TMPDIR/tray-<uid>, unless
    another user could change a directory above it or holds that name (then ~/.cache/tray-jobs)."""
    explicit = os.environ.get("TRAY_JOBS_ROOT")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        try:
            st = os.lstat(xdg)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
            return Path(xdg) / "tray"
    tmp = _tmp_root()
    home = Path(os.path.expanduser("~"))
    if _tmp_refused(tmp) is not None and _own_dir(home) and unsafe_ancestor(home / ".cache" / "x") is None:
        # NOTE: a temporary directory others may change (a container's /tmp volume of mode 0777, not sticky), or one
        # where another user took the name first (anyone may mkdir /tmp/tray-<uid> for any uid, and this user cannot
        # remove it from a sticky /tmp): the user's own cache instead
        return home / ".cache" / "tray-jobs"
    return tmp


def _tmp_root() -> Path:
    return Path(tempfile.gettempdir()) / f"tray-{os.getuid()}"


def _tmp_refused(tmp: Path) -> str | None:
    """Why the jobs root in the temporary directory, `tmp`, is not used, or None."""
    if _taken(tmp):
        return f"{tmp} exists and is not a directory of this user"
    problem = unsafe_ancestor(tmp)
    return f"{tmp} {problem}" if problem else None


def _named(root: Path | None) -> bool:
    """Whether the jobs root is one the user named (TRAY_JOBS_ROOT, or the caller's), not tray's default: a named one
    may be a shared directory (/tmp), which tray never advises removing."""
    return root is not None or bool(os.environ.get("TRAY_JOBS_ROOT"))


def _make_it_hint(root: Path | None, path: Path) -> str:
    """What to do about a jobs root `path` that could not be made; for the home's fallback, why the temporary
    directory's was not taken."""
    named = _named(root)
    made = ("TRAY_JOBS_ROOT names it: set it to a directory you may make (tray makes it 0700)" if named
            else "set TRAY_JOBS_ROOT to a directory of your own (0700)")
    refused = None if named else _tmp_refused(_tmp_root())
    if refused and path.name == "tray-jobs":
        made += f" (the temporary directory's was not taken: {refused})"
    return made


def _taken(path: Path) -> bool:
    """Whether `path` exists as something other than a directory of this user (a link, a file, another's dir)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid()


def open_root(root: Path | None = None, before_making: Callable[[Path], None] | None = None) -> tuple[Path, int]:
    """Create (0700) or open the jobs root without following a link at its last component; check
    owner and mode through the fd. Returns (path, fd). Raises SetupError saying what is wrong.
    `before_making(path)`, when the root is not there yet, may refuse it (raising) before anything is made."""
    path = Path(root) if root is not None else default_root()
    hint = "set TRAY_JOBS_ROOT to a directory of your own (a new path: tray makes it 0700)" if _named(root) else \
        "remove it or set TRAY_JOBS_ROOT to a directory of your own"
    # NOTE: asked before anything is made too (and again, through the fd, after): a jobs root refused must not be
    # left behind, in another user's directory
    if not os.path.lexists(path):
        if problem := unsafe_ancestor(path):
            raise SetupError(f"jobs root {path} {problem}; {hint}")
        above = path
        while not os.path.lexists(above) and above.parent != above:
            above = above.parent
        if before_making is not None and os.path.isdir(above):  # a file on the way is said below, nothing made
            before_making(path)
    try:
        make_private_dirs(path.parent)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SetupError(f"jobs root {path} is a symbolic link or not a directory; {hint}") from None
        if exc.errno == errno.EEXIST and exc.filename not in (None, str(path)):  # makedirs met a file on the way
            raise SetupError(f"cannot create the jobs root {path}: {exc.filename} is not a directory; {hint}") from None
        raise SetupError(f"cannot create the jobs root {path}: {exc.strerror}; "
                         f"{hint if os.path.lexists(path) else _make_it_hint(root, path)}") from None
    st = os.fstat(fd)
    problem = None
    if st.st_uid != os.getuid():
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    elif stat.S_IMODE(st.st_mode) & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}, expected 0700 (others could enter it)"
        hint = f"chmod 700 {path} if it is yours alone, else {hint}"
    problem = problem or unsafe_ancestor(path)
    if problem:
        os.close(fd)
        raise SetupError(f"jobs root {path} {problem}; {hint}")
    return path, fd


def _own_dir(path: Path) -> bool:
    """Whether `path` is an absolute, existing directory of this user (a home to fall back to)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return path.is_absolute() and path != Path("/") and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def others_may_change(st: os.stat_result) -> str | None:
    """Why another user could rename or replace entries of the directory `st` describes, or None: it belongs to
    another user (not root), or others may write in it without the sticky bit. A group-writable directory is
    others' only when its group has other members than this user (not a user-private group, as umask 002 makes)."""
    return _others_may_write(st, sticky_stops_them=True)


def _others_may_write(st: os.stat_result, sticky_stops_them: bool = False) -> str | None:
    """Why users other than this one (and root) may make entries in the directory `st` describes, or None; with
    `sticky_stops_them`, None for a sticky one they do not own (they may not touch others' entries there)."""
    if st.st_uid not in (os.getuid(), 0):
        return f"owned by uid {st.st_uid}"
    if sticky_stops_them and st.st_mode & stat.S_ISVTX:
        return None
    if st.st_mode & stat.S_IWOTH:
        return f"mode {stat.S_IMODE(st.st_mode):04o}: anyone may write in it"
    if st.st_mode & stat.S_IWGRP and not private_group(st.st_gid):
        return f"mode {stat.S_IMODE(st.st_mode):04o}: its group (gid {st.st_gid}) may write in it"
    return None


def private_group(gid: int) -> bool:
    """Whether group `gid` is this user's own: its primary group, named as the user, with no other member listed
    (a user-private group, as Debian and Fedora give every user)."""
    import grp
    import pwd

    if gid != os.getgid():
        return False
    try:
        me = pwd.getpwuid(os.getuid()).pw_name
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    if group.gr_name != me or set(group.gr_mem) - {me}:
        return False
    # NOTE: gr_mem lists only supplementary members; another user whose primary group this is may write too
    return not any(p.pw_gid == gid and p.pw_uid != os.getuid() for p in pwd.getpwall())


def make_private_dirs(path: Path, mode: int = 0o700) -> None:
    """mkdir -p `path` with every directory it makes of `mode` exactly (os.makedirs gives the intermediate ones the
    umask's mode, group-writable under umask 002, which the checks here would then refuse)."""
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    if not os.path.isdir(p):  # as os.makedirs says it: a file on the way
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(p))
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue
        os.chmod(d, mode)


def unsafe_ancestor(path: Path) -> str | None:
    """What makes the directories above the jobs root unsafe, or None: another user must not be able to move the
    jobs root aside and put a directory of theirs at its path (ranks reach the head's socket by path, and would
    send it their token); see others_may_change. Links are resolved, and each link met on the way must lie in a
    directory no other user may change, nor may any directory above that one (anyone who may replace the link, or
    move its directory, could point the ranks, which reach the job dir by its path, elsewhere); in a sticky one others
    write in, it must be this user's or root's (its owner may remove it there)."""
    # NOTE: not os.path.abspath: it drops `link/..` before the link is looked at, where the kernel follows the link
    parent = str(path.parent) if path.is_absolute() else os.path.join(os.getcwd(), str(path.parent))
    for link, holder, st in _links_on_the_way(parent):
        # NOTE: a link's target never changes: to point it elsewhere is to remove it and make another, which takes
        # leave to write in its directory; its owner has that leave over it alone in a sticky one others may write in
        try:
            others_write = _others_may_write(os.stat(holder)) is not None
        except OSError:
            others_write = False
        if st.st_uid not in (os.getuid(), 0) and others_write:
            return (f"lies under the link {link} (owned by uid {st.st_uid}) in {holder}, where its owner may "
                    "remove it and put one pointing at a directory of theirs")
        # the link's directory and every one above it: who could move any of them could put another link in its place
        for d in (holder, *map(str, Path(holder).parents)):
            try:
                why = others_may_change(os.stat(d))
            except OSError:
                continue
            if why:
                where = f"in {holder}" if d == holder else f"in {holder}, under {d}"
                return f"lies under the link {link}, {where} ({why}), where another user could replace the link"
    for parent in Path(os.path.realpath(path.parent)).joinpath("x").parents:
        try:
            st = os.stat(parent)
        except OSError:
            continue
        why = others_may_change(st)
        if why:
            return f"lies under {parent} ({why}), where another user could move it and put their own in its place"
    return None


def _links_on_the_way(path: str) -> Iterator[tuple[str, str, os.stat_result]]:
    """(link, the directory holding it, its lstat) for every symbolic link met while resolving the absolute `path`
    component by component, as the kernel does (links inside a link's target included); stops at the first component
    that does not exist (tray makes the rest, 0700), and after 40 links (a loop)."""
    pending = [p for p in reversed(path.split("/")) if p]
    cur, links = "/", 0
    while pending:
        name = pending.pop()
        if name == ".":
            continue
        if name == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, name)
        try:
            st = os.lstat(nxt)
        except OSError:
            return
        if not stat.S_ISLNK(st.st_mode):
            cur = nxt
            continue
        yield nxt, cur, st
        links += 1
        if links > 40:
            return
        target = os.readlink(nxt)
        if target.startswith("/"):
            cur = "/"
        pending.extend(p for p in reversed(target.split("/")) if p)


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # bytes the file system encoding could not decode (os.fsdecode's surrogates)
        return False
    return True


# the kinds of locked directory under the jobs root: a tray's job dir, and a command's scratch dir (the files a
# gate's or bench's ranks leave for it); the sweep removes either once no live process holds its lock
KINDS = ("job", "scratch")


def _check_socket_paths(path: Path, name: str, nprocs: int) -> None:
    """SetupError when a socket of job dir `name` under the jobs root `path` could not be bound: a path longer than
    a UNIX socket allows (for ranks 0..nprocs-1), or not UTF-8."""
    # NOTE: sun_path counts bytes (a character outside ASCII is several), and ZeroMQ takes its ipc:// address as
    # UTF-8 text, so a name the file system holds in another encoding cannot be bound at all
    longest = max(len(os.fsencode(path / name / f"rank-{nprocs - 1}.fds")),
                  len(os.fsencode(path / name / "head.sock")))
    if longest > MAX_SOCKET_PATH:
        raise SetupError(
            f"socket paths under the jobs root {path_text(path)} would be {longest} bytes; UNIX sockets allow "
            f"{MAX_SOCKET_PATH}: set TRAY_JOBS_ROOT to a shorter directory (e.g. /tmp/tray-{os.getuid()})")
    if not _utf8(str(path)):
        raise SetupError(
            f"the jobs root {path_text(path)} is not a UTF-8 path, and the head's socket (ZeroMQ) takes its "
            f"address as UTF-8: set TRAY_JOBS_ROOT to a directory whose path is (e.g. /tmp/tray-{os.getuid()})")


def make_job_dir(nprocs: int, root: Path | None = None, kind: str = "job") -> JobDir:
    """Sweep stale job dirs, then make a new locked one, 0700, named `<kind>-<pid>-<random>`.

    The name appears only once the lock is held (made as `.new-*`, renamed), so the sweep never sees
    a live job dir without its lock. Raises SetupError when the root is unusable or a socket path
    under it would be longer than a UNIX socket allows (for ranks 0..nprocs-1)."""
    assert kind in KINDS, kind
    name = f"{kind}-{os.getpid()}-{secrets.token_hex(4)}"

    def check(path: Path) -> None:
        if kind == "job":
            _check_socket_paths(path, name, nprocs)

    # NOTE: a root not made yet is checked before it is: one refused must not be left behind
    path, root_fd = open_root(root, before_making=check)
    try:
        check(path)
        sweep_stale(root_fd)
        temp = f".new-{name}"
        try:
            os.mkdir(temp, 0o700, dir_fd=root_fd)
            fd = os.open(temp, _DIR_FLAGS, dir_fd=root_fd)
            lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600, dir_fd=fd)
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(temp, name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        except OSError as exc:
            _remove_entry(root_fd, temp)
            raise SetupError(f"cannot create a job dir in {path}: {exc.strerror}; free space or inodes "
                              "there, or set TRAY_JOBS_ROOT") from None
    except BaseException:
        os.close(root_fd)
        raise
    return JobDir(path=path / name, root=path, root_fd=root_fd, fd=fd, lock_fd=lock_fd)


@contextmanager
def scratch_dir() -> Iterator[Path]:
    """A private directory (0700) under the jobs root for the files a command's ranks write for it, removed when
    the block ends; locked as a job dir is, so that if this process is killed the next tray's sweep removes it."""
    path, remove = work_dir(None)
    try:
        yield path
    finally:
        remove()


def work_dir(keep_prefix: str | None) -> tuple[Path, Callable[[], None]]:
    """A gate's or bench's working directory and what removes it: a scratch dir (scratch_dir), or with
    `keep_prefix` (--keep) a plain temporary directory named so, which is kept."""
    if keep_prefix is not None:
        return Path(tempfile.mkdtemp(prefix=keep_prefix)), lambda: None
    scratch = make_job_dir(1, kind="scratch")
    return scratch.path, scratch.close


def _remove_entry(root_fd: int, name: str) -> None:
    try:
        shutil.rmtree(name, dir_fd=root_fd, ignore_errors=True)
    except OSError:
        pass


def try_lock(root_fd: int, name: str) -> int | None:
    """The fd of `name`'s lock, now held by us, if no live head holds it; None if it is live (or not
    a real directory of ours). A job dir without a lock file is stale (a live one always has it)."""
    try:
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return None
        dfd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return None
    try:
        lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return os.dup(dfd)  # nothing to hold: stand in with the dir fd
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock_fd)
        return None
    return lock_fd


def still_named(fd: int, name: str, dir_fd: int) -> bool:
    """Whether `name` under `dir_fd` is still the file open at `fd` (not removed, nor made anew)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _remove_unlocked(root_fd: int, name: str) -> None:
    """Remove lock file `name` when no live process holds it (tray/launch/ports.py)."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if still_named(fd, name, root_fd):  # else a new tray's file took that name meanwhile
            os.unlink(name, dir_fd=root_fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sweep_stale(root_fd: int) -> list[str]:
    """Remove job dirs no live head holds (a head killed with SIGKILL, and its watchdog, gone), and
    the NCCL segments their ranks left in /dev/shm. Returns the names removed."""
    removed = []
    now = time.time()
    for entry in os.scandir(root_fd):
        name = entry.name
        if name.startswith(tuple(f".new-{kind}-" for kind in KINDS)):
            try:
                old = now - entry.stat(follow_symlinks=False).st_mtime > HALF_MADE_AGE_S
            except OSError:
                continue
            if old:
                _remove_entry(root_fd, name)
                removed.append(name)
            continue
        if name.startswith("port-") and name.endswith(".lock"):  # a --master-port lock its tray did not remove
            _remove_unlocked(root_fd, name)
            continue
        if not name.startswith(tuple(f"{kind}-" for kind in KINDS)):
            continue
        lock_fd = try_lock(root_fd, name)
        if lock_fd is None:
            continue
        try:
            remove_recorded_shm(root_fd, name)
            _remove_entry(root_fd, name)
            removed.append(name)
        finally:
            os.close(lock_fd)
    return removed
