"""NCCL joined while the ranks start (cuda backend, one node), instead of at the first collective.

A rank's first NCCL join costs 0.3-0.45 s, most of it NCCL setting up its kernels on the device (once per process:
bench/results/h200/nccl_lifecycle.json), and the lazy join (tray/rank/wiring.py, LazyCollectives) pays it after
"ready", at the first collective. When a tray will use its collectives, that time can overlap the ranks'
start instead:

  1. the head has one unique id made per group instance right after spawning the ranks, by a process of its
     own in the tray's process group (tray/collectives/idmaker.py: ncclGetUniqueId needs no CUDA, but leaves
     NCCL's bootstrap root, a thread and a socket, in its caller until every member came), and writes every
     rank's groups with their ids to `nccl-ids.json` in the job dir (0700), whose path the ranks got as
     TRAY_NCCL_IDS;
  2. each rank, on a thread started by `tray.init()` (`EarlyJoin`), once its main thread has opened the device
     and allocated its buffers (`begin()`), reads that file, makes the device's primary context current and
     joins its groups (one ncclGroupStart/End), while the main thread offers, waits for the table, maps its
     peers, waits for the go and runs the program up to its first collective;
  3. the first collective takes the communicators (`EarlyJoin.take`), waiting only for what is left.

Why not sooner: the join needs the CUDA context, which the driver warm-up makes (~0.3 s) while the rank still
imports, and a join started as soon as the context existed slowed the device's opening and the allocations
beside it (one H200: ready 1.008 against 0.868 s, bench/results/h200/startup_early_at_context.json) for no gain,
the rank's own work after the context (~0.15 s) being shorter than the join (~0.45 s).

Which trays join early (`tray launch --join-collectives`): `early` always on cuda, `lazy` never, `auto` (the
default) when a manifest program has a collective op. A job of several nodes joins lazily (its ids travel
through the root). When the head cannot make the ids (no NCCL in its Python) it writes why, and every rank
joins lazily: the choice is the head's, so all ranks make the same one.

Pure at import: the head imports this module; NCCL and the driver are imported on the join's thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tray.collectives.idmaker import IdMaker
from tray.envvars import JOIN_MODES
from tray.errors import DeviceError, HandshakeError, UsageError

if TYPE_CHECKING:
    from tray.backend.base import GroupInfo
    from tray.manifest import ResolvedManifest

IDS_ENV = "TRAY_NCCL_IDS"  # the ids file's path, set by the head for ranks that join early
IDS_FILE = "nccl-ids.json"
_POLL_S = 0.002  # how often a rank looks for the ids file (the head writes it ~0.13 s after the spawn: long before)


@dataclass(frozen=True)
class Entry:
    """One group instance of one rank: its members (global ranks, member order), this rank's index and the
    instance's NCCL unique id."""

    group: str
    members: tuple[int, ...]
    index: int
    uid: bytes


def uses_collectives(resolved: ResolvedManifest) -> bool:
    """Whether a program of the manifest has a collective op (`"op": "nccl"`)."""
    return any(op.op == "nccl" for p in resolved.programs.values() for op in p.ops)


def wanted(mode: str, backend: str, resolved: ResolvedManifest) -> bool:
    """Whether a one-node tray joins early: `mode` is one of JOIN_MODES (UsageError otherwise)."""
    if mode not in JOIN_MODES:
        raise UsageError(f"--join-collectives must be one of {', '.join(JOIN_MODES)}, got {mode!r}")
    if backend != "cuda" or mode == "lazy":
        return False
    return mode == "early" or uses_collectives(resolved)


def _instances(resolved: ResolvedManifest, ranks: Iterable[int]) -> Iterator[tuple[int, str, tuple[int, ...]]]:
    """(rank, group, members) of every group instance of every rank in `ranks`: those `tray.rank.lifecycle`
    gives a rank (`resolved.group_of`), in manifest order."""
    for rank in ranks:
        for name in resolved.groups:
            members = resolved.group_of(name, rank)
            if members is not None:
                yield rank, name, tuple(members)


def instance_count(resolved: ResolvedManifest, ranks: Iterable[int]) -> int:
    """How many ids `plan` asks for: one per distinct group instance of `ranks`."""
    return len({(name, members) for _, name, members in _instances(resolved, ranks)})


def plan(resolved: ResolvedManifest, ranks: Iterable[int], make_id: Callable[[], bytes]) -> dict[int, list[Entry]]:
    """Every rank's group instances with their ids: one `make_id()` per instance, shared by its members."""
    ranks = list(ranks)
    ids: dict[tuple[str, tuple[int, ...]], bytes] = {}
    out: dict[int, list[Entry]] = {rank: [] for rank in ranks}
    for rank, name, members in _instances(resolved, ranks):
        if (name, members) not in ids:
            ids[name, members] = make_id()
        out[rank].append(Entry(name, members, members.index(rank), ids[name, members]))
    return out


def write_ids(path: Path, plans: dict[int, list[Entry]] | None, error: str = "", made_s: float = 0.0) -> None:
    """The ids file, atomically (a rank never reads half of it): every rank's entries, or `error` (why the
    head made none: the ranks then join lazily); `made_s`, the head's time making them."""
    body: dict[str, Any] = {"error": error} if plans is None else {
        "ranks": {str(r): [[e.group, list(e.members), e.index, e.uid.hex()] for e in es] for r, es in plans.items()}}
    body["made_s"] = made_s
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a new file, never through whatever sits at the name
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(body, f)
    os.replace(tmp, path)


class StartJoin:
    """The head's part of the early join (step 1 above) for its ranks `ranks` of manifest `resolved`: `wanted`,
    whether they join while they start; `start(process_group)`, the id process, right after the spawn (before
    any thread of the head: a fork from a lone thread); `write(job_dir)` (on a thread), the ranks' ids file;
    `rank_env(job_dir)`, what a rank needs to find it; `pid`, the id process's; `close()`, its end; `said()`, the
    line the head's startup summary prints. The head knows the early join by no more than this."""

    def __init__(self, mode: str, backend: str, resolved: ResolvedManifest, ranks: range) -> None:
        self.wanted = wanted(mode, backend, resolved)
        self._resolved = resolved
        self._ranks = ranks
        self.made_s: float | None = None  # the head's time making the ids (the id process's start included)
        self.error = ""  # why no ids were made (the ranks then join lazily)
        self._maker: IdMaker | None = None

    def start(self, process_group: int) -> None:
        if not self.wanted:
            return
        try:
            self._maker = IdMaker(instance_count(self._resolved, self._ranks), process_group)
        except OSError as exc:
            self.error = f"the head could not start its NCCL id process ({sys.executable}): {exc.strerror}"

    @property
    def pid(self) -> int | None:
        return self._maker.popen.pid if self._maker is not None else None

    def rank_env(self, job_dir: Path) -> dict[str, str]:
        return {IDS_ENV: str(job_dir / IDS_FILE)} if self.wanted else {}

    def write(self, job_dir: Path, say: Callable[[str], None]) -> None:
        """Every rank's NCCL groups with their unique ids, made by the id process while the ranks import
        (ncclGetUniqueId needs no CUDA). When NCCL cannot make them, the file says why and every rank joins
        lazily; the head goes on (`say` tells it, should the file itself be impossible to write)."""
        path = job_dir / IDS_FILE
        t0 = self._maker.t_start if self._maker is not None else time.perf_counter()
        plans = None
        error = self.error or ("" if self._maker is not None else "the head started no NCCL id process")
        try:
            if self._maker is not None:
                ids = iter(self._maker.answer())
                plans = plan(self._resolved, self._ranks, lambda: next(ids))
        except Exception as exc:  # NOTE: an early join is an optimisation; the lazy one still works (or says why not)
            error = f"the head could not make NCCL ids: {exc}"
        self.made_s = time.perf_counter() - t0
        self.error = error
        try:
            write_ids(path, plans, error=error, made_s=self.made_s)
        except OSError as exc:
            if path.parent.is_dir():  # else the tray already ended (its job dir is gone): no rank waits for the file
                say(f"cannot write the NCCL ids for the ranks' early join to {path}: {exc.strerror}; the ranks' "
                    "first collective will fail naming that file (--join-collectives lazy avoids it)")

    def differs(self, resolved: ResolvedManifest) -> str:
        """"" when manifest `resolved` gives this head's ranks the group instances the ids are planned for (so the
        ids hold for it too); else what differs."""
        planned, theirs = set(_instances(self._resolved, self._ranks)), set(_instances(resolved, self._ranks))
        if planned == theirs:
            return ""
        fmt = lambda items: ", ".join(sorted({f"{n} {list(m)}" for _, n, m in items})) or "none"  # noqa: E731
        return f"the ids are for {fmt(planned - theirs)} where the ranks' manifest has {fmt(theirs - planned)}"

    def close(self) -> None:
        if self._maker is not None:
            self._maker.close()  # killed with the tray's process group by now, or done: reaped here

    def said(self) -> str | None:
        """The startup summary's line on the early join; None when the ranks join at their first collective."""
        if not self.wanted:
            return None
        if self.error:
            return f"NCCL: the ranks join at the first collective: {self.error}"
        made = f" (their ids made in {self.made_s * 1e3:.0f} ms by the head's id process)" if self.made_s else ""
        return (f"NCCL: the ranks join their groups on a thread from their allocations on{made}; the first "
                "collective waits for what is left (--join-collectives lazy: at the first collective instead)")

    @staticmethod
    def shared_gpu_env(rank: int) -> dict[str, str]:
        """A rank on a GPU other ranks share (--share-gpus): NCCL refuses two ranks of one host on one GPU, so
        each gets a host of its own, this host's (the environment's NCCL_HOSTID, else its name) and the rank."""
        return {"NCCL_HOSTID": f"{os.environ.get('NCCL_HOSTID') or socket.gethostname()}/tray-rank-{rank}"}


def read_ids(path: str, rank: int, timeout_s: float) -> tuple[list[Entry] | None, str, float]:
    """This rank's entries once the head wrote them, or None and why when the head made none; and the head's
    time making them. Waits at most `timeout_s` for the file (HandshakeError naming it past that)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as f:
                body = json.load(f)
            break
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise HandshakeError(f"the head did not write the NCCL ids ({path}) within {timeout_s:g} s of this "
                                     f"rank's allocations; is the head alive?") from None
            time.sleep(_POLL_S)
    made_s = float(body.get("made_s", 0.0))
    if "ranks" not in body:
        return None, str(body.get("error", "the head made no ids")), made_s
    try:
        rows = body["ranks"][str(rank)]
        return [Entry(str(g), tuple(int(m) for m in ms), int(i), bytes.fromhex(u)) for g, ms, i, u in rows], "", made_s
    except (KeyError, TypeError, ValueError) as exc:
        raise HandshakeError(f"{path} holds no valid entries for rank {rank}: {exc!r}") from None


def _nccl_join(entries: Sequence[Entry], ordinal: int, steps: dict[str, float]) -> tuple[dict[str, Any],
                                                                                     Callable[[], None]]:
    """The real join (cuda): device `ordinal`'s primary context retained and made current on this thread,
    then every group joined at once. Returns the NcclGroups (stream 0 until adopted) and what releases the
    context reference once they are destroyed; `steps` gets the seconds of each part (context, import, init)."""
    t0 = time.perf_counter()
    from tray.backend.base import GroupInfo
    from tray.backend.cuda import driver as drv

    drv.init()
    device = drv.device_get(ordinal)
    ctx = drv.primary_ctx_retain(device)
    t1 = time.perf_counter()
    steps["context"] = t1 - t0
    try:
        drv.ctx_set_current(ctx, ordinal)
        from tray.collectives.nccl import _nccl, join_all

        _nccl()
        t2 = time.perf_counter()
        steps["import"] = t2 - t1
        # NOTE: the rank's program may begin a CUDA graph capture in GLOBAL mode (torch.cuda.graph's default)
        # while this runs: that mode prohibits unsafe calls on every thread that has not relaxed its own. With
        # this thread in GLOBAL mode, such a capture failed and so did the join (ncclUnhandledCudaError), one H200:
        # tests/gpu/test_torch.py -k global_torch_capture
        previous = drv.thread_capture_mode_relaxed()
        try:
            groups = join_all([(GroupInfo(e.group, e.members, e.index), e.uid) for e in entries], 0, ordinal)
        finally:
            drv.thread_capture_mode_restore(previous)
        steps["init"] = time.perf_counter() - t2
    except BaseException:
        drv.primary_ctx_release(device)
        raise
    return dict(groups), lambda: drv.primary_ctx_release(device)


class EarlyJoin:
    """A rank's early join, on its own thread from construction: read the ids, join (`join`, by default
    NCCL on device `ordinal`). `take()` hands the joined collectives over once; at close, `leftovers()`
    gives what nothing took, and `release()` drops the context reference once they are closed. `seconds`
    is the thread's time to the join's end (the wait for begin() included), `waited_s` how long `take()` waited,
    `steps` the seconds of its parts from the thread's start (begin: the rank let the join start; ids: the head's
    file read), then those `join` reports (context, import, init); and head_ids, the head's time making them."""

    def __init__(self, path: str, rank: int, ordinal: int, timeout_s: float = 60.0,
                 join: Callable[[Sequence[Entry], int, dict[str, float]],
                                tuple[dict[str, Any], Callable[[], None]]] = _nccl_join) -> None:
        self.path = path
        self.rank = rank
        self.ordinal = ordinal
        self.seconds: float | None = None
        self.waited_s: float | None = None
        self.lazy_because = ""  # why the head made no ids (the rank then joins lazily)
        self.steps: dict[str, float] = {}
        self.step = "waiting for the rank's allocations"  # where the thread is, for a timeout's message
        self._timeout_s = timeout_s
        self._join = join
        self._entries: list[Entry] | None = None
        self._groups: dict[str, Any] | None = None
        self._release: Callable[[], None] | None = None
        self._failure: BaseException | None = None
        self._taken = False
        self._go = threading.Event()  # begin() or cancel()
        self._cancelled = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tray-nccl-early", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            # NOTE: nothing before begin(): a thread polling for the file while the rank imports would take the GIL
            # from the imports every few ms
            self._go.wait()
            self.steps["begin"] = time.perf_counter() - t0
            if self._cancelled:
                return
            self.step = f"waiting for the head's NCCL ids ({self.path})"
            self._entries, self.lazy_because, self.steps["head_ids"] = read_ids(self.path, self.rank,
                                                                                 self._timeout_s)
            self.steps["ids"] = time.perf_counter() - t0
            if self._cancelled:  # the rank's start failed while this waited for the ids: no join for a failed tray
                return
            if self._entries is not None:
                self.step = "in ncclCommInitRank for " + ", ".join(
                    f"{e.group} (ranks {', '.join(map(str, e.members))})" for e in self._entries)
                self._groups, self._release = self._join(self._entries, self.ordinal, self.steps)
                self.step = "joined"
        except BaseException as exc:  # NOTE: raised on the rank's thread by take()
            self._failure = exc
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def begin(self) -> None:
        """Let the join start (the rank's device is open and its buffers allocated)."""
        self._go.set()

    def cancel(self) -> None:
        """A start-up that failed: the thread ends without joining (before `begin()`, or while it waits for the ids; a
        join already in NCCL is left to the process's end)."""
        self._cancelled = True
        self._go.set()

    def take(self, timeout_s: float = 60.0) -> dict[str, Any] | None:
        """The joined collectives by group name, or None when the head made no ids (join lazily then).
        Waits at most `timeout_s`. Raises DeviceError (or what the join raised) when the join failed, and
        again at every later call."""
        if self._taken and self._failure is None:
            raise UsageError("EarlyJoin.take() called twice")
        t0 = time.perf_counter()
        if not self._done.wait(timeout_s):
            raise DeviceError(
                f"rank {self.rank}: the NCCL join started with the rank did not finish within {timeout_s:g} s of its "
                f"first collective; its thread is {self.step}. Every rank of the tray passed its start, so a member "
                "that never joined, or NCCL itself, is stuck (NCCL_DEBUG=INFO shows where; --join-collectives lazy "
                "joins at the first collective instead)")
        self.waited_s = time.perf_counter() - t0
        self._taken = True
        if self._failure is not None:
            if isinstance(self._failure, (DeviceError, HandshakeError, UsageError)):
                raise self._failure
            raise DeviceError(f"rank {self.rank}: the NCCL join started at start-up failed: {self._failure!r}") \
                from self._failure
        return self._groups

    def mismatch(self, groups: Iterable[GroupInfo]) -> str:
        """"" when the early join joined exactly `groups` (name, members, index), the groups the rank's own
        manifest gives it; else what differs."""
        mine = {(g.name, tuple(g.members), g.index) for g in groups}
        joined = {(e.group, e.members, e.index) for e in self._entries or ()}
        if mine == joined:
            return ""
        fmt = lambda items: ", ".join(f"{n} {list(m)} as member {i}" for n, m, i in sorted(items)) or "none"  # noqa: E731
        return f"the head planned {fmt(joined - mine)}; this rank's manifest gives {fmt(mine - joined)}"

    def release(self) -> None:
        """Drop the join's context reference (after its communicators are closed)."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def leftovers(self, timeout_s: float | None = None) -> dict[str, Any]:
        """At close: what the join made when nothing took it (the caller closes it, then `release()`s).
        Waits for the join at most `timeout_s` (default: as long as a communicator's close may take, NcclGroup's
        close_timeout_s); a join still running then, or failed, leaves nothing."""
        if timeout_s is None:
            from tray.collectives.nccl import close_timeout_s

            timeout_s = close_timeout_s()
        if self._taken:
            return {}
        self._taken = True
        if not self._done.wait(timeout_s):
            return {}
        groups, self._groups = self._groups or {}, None
        return groups


def from_environ(rank: int, ordinal: int, timeout_s: float, environ: dict[str, str] | None = None) -> EarlyJoin | None:
    """The early join this rank takes part in (TRAY_NCCL_IDS set by the head), started; None otherwise."""
    env = os.environ if environ is None else environ
    path = env.get(IDS_ENV)
    job = env.get("TRAY_JOB")
    if not path or not job or env.get("TRAY_BACKEND") != "cuda" or Path(path).parent != Path(job):
        return None  # only a file in this rank's own job dir: the head of this tray made it
    return EarlyJoin(path, rank, ordinal, timeout_s)


__all__ = ["IDS_ENV", "IDS_FILE", "JOIN_MODES", "EarlyJoin", "Entry", "from_environ", "instance_count", "plan",
           "read_ids", "uses_collectives", "wanted", "write_ids"]
