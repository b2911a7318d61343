"""The rank: `tray.init()` runs the eight steps of docs/design.md section 2 (tray/rank/lifecycle.py) and hands
back a `Rank`, the public face over the frozen wiring they built.

    with tray.init() as rank:
        rank.barrier()
        x = rank.read("x")            # numpy array of the buffer's dtype and shape
        peers = rank.peers("x")       # PeerTable: every member's address, member order
        t = torch.from_dlpack(rank.peer_view("x", 1))   # zero-copy views (tray.rank.views)

An exception leaving the `with` block is reported to the head (the tray's root cause) and re-raised.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import stat
import sys
import threading
import time
import traceback
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tray.backend.base import Backend, Barrier, Collectives, GroupInfo, Kernel, numpy_dtype, seal_kernel
from tray.errors import SetupError, UsageError, WireError
from tray.handshake import wire
from tray.handshake.steps import JOIN_TOPIC, PARK_TOPIC, Rounds, describe_step
from tray.manifest import Manifest, ResolvedManifest
from tray.manifest.expr import did_you_mean, known_list
from tray.rank import lifecycle
from tray.rank.args import int_arg, name_arg, seconds_arg, shown, stream_arg
from tray.rank.env import RankEnv
from tray.rank.phases import PhaseClock
from tray.rank.views import BufferView, Leases, check_member
from tray.rank.wiring import Buffer, Parts, PeerTable, RankContext, Wiring

if TYPE_CHECKING:
    from tray.park import ParkedSession, Parking, Session
    from tray.rank.executor import Executor
    from tray.weights import WeightsReport

__all__ = ["Buffer", "BufferView", "PeerTable", "Rank", "RankContext", "init"]


# the process that called tray.init(), once it did (it may be called once: a second offer would be refused by the
# head); a child forked after it inherits this, not the tray
_initialised_pid: int | None = None
# set in a child forked after tray.init() (os.register_at_fork), so that the rank's own calls need no getpid()
_forked_after_init = False


def _after_fork_in_child() -> None:
    global _forked_after_init
    if _initialised_pid is not None:
        _forked_after_init = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def init(manifest: str | os.PathLike[str] | None = None, timeout_s: float = 60.0, warmup: Any = None,
         early: Any = None) -> Rank:
    """Join the tray this process was launched into. Blocks until every rank is ready (`go`).

    `manifest` overrides TRAY_MANIFEST (every rank must load the same one: the head checks).
    `warmup`: a started `tray.backend.cuda.DriverWarmup` (tray.init makes one on the cuda backend);
    `early`: a started `tray.collectives.early.EarlyJoin` (tray.init starts one when the head made NCCL ids;
    started here otherwise, since every member of a group must join it).
    Raises UsageError outside a tray or when this process already called it, HandshakeError when the tray cannot
    form.
    """
    global _initialised_pid
    try:
        timeout_s = seconds_arg("tray.init()", timeout_s)
        if isinstance(manifest, os.PathLike):
            manifest = os.fspath(manifest)
        if manifest is not None and not isinstance(manifest, str):
            raise UsageError(f"tray.init(manifest=...): a manifest file's path or a built-in's name (a str or a "
                             f"pathlib.Path), got {shown(manifest)}; or leave it out for the launch's --manifest")
        if manifest == "":
            raise UsageError("tray.init(manifest=''): the manifest's name is empty; give a manifest file's path or a "
                             "built-in's name (`tray inspect --list`), or leave it out for the launch's --manifest")
        wrong = None
    except UsageError as exc:
        wrong = exc
    if wrong is not None:
        if warmup is not None:
            warmup.release()
        if early is not None:
            early.cancel()
        try:
            env = RankEnv.from_environ()
        except UsageError:
            raise wrong from None
        _report(env, "spawn", None, wrong)  # the error file: the head says it in one line, as a usage error
        raise wrong
    if _initialised_pid is not None:
        if warmup is not None:
            warmup.release()
        if early is not None:
            early.cancel()
        if _initialised_pid != os.getpid():
            raise UsageError(_forked_child(f"process {os.getpid()} called tray.init()", _initialised_pid))
        raise UsageError("tray.init() was already called in this process: a rank joins its tray once (the head "
                         "knows it by its process); keep the first Rank, or launch a new tray")
    try:
        env = RankEnv.from_environ()
    except BaseException:
        if warmup is not None:
            warmup.release()
        if early is not None:
            early.cancel()
        raise
    _initialised_pid = os.getpid()
    if early is None:
        from tray.collectives import early as early_join

        early = early_join.from_environ(env.rank, env.device, timeout_s)
    parts = Parts(env, PhaseClock(), early=early)
    try:
        assert manifest is None or isinstance(manifest, str)  # checked above, a Path made a str
        try:
            wiring = lifecycle.start(parts, manifest or env.manifest or None, timeout_s, warmup)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            from tray.handshake.fdpass import fd_limit_said

            # NOTE: a rank maps every peer's buffers (an fd each while it imports them) and holds its sockets: a
            # limit the program lowered, or one set low for the job, ends here, wherever the next descriptor was due
            raise SetupError(f"rank {env.rank} ran out of file descriptors in tray.init() (phase "
                             f"{parts.phases.current}: {exc.strerror}): {fd_limit_said()}; raise it (ulimit -n before "
                             "the launch; a program that lowers it with resource.setrlimit leaves the tray too few), "
                             "or export fewer buffers") from exc
    except BaseException as exc:
        # NOTE: an interruption (SIGINT) or an exit is no error of the rank's, as in Rank.__exit__: the head names the
        # signal or the exit code, or takes it for the whole tray's Ctrl-C when it got one too
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            _report(env, parts.phases.current, parts.client, exc)
        parts.close()
        raise
    return Rank(wiring)


class Rank:
    """One member of a tray, up and wired. Build with `tray.init()`; use as a context manager."""

    def __init__(self, wiring: Wiring) -> None:
        self._wiring = wiring
        self.env = wiring.env
        self.rank = wiring.env.rank
        self.world_size = wiring.env.world_size
        self.local_rank = wiring.env.local_rank
        self._kernels: dict[str, Kernel] = {}
        self._rounds = Rounds()  # the rounds of this rank's tray-wide steps, per topic (bounded)
        self._executor: Executor | None = None
        self._park: Parking | None = None
        self._leases = Leases()  # live views of this rank's memory (tray/rank/views.py)
        self._closed = False
        self._reported = False  # an ErrorReport went to the head: no bye after it
        self._pid = os.getpid()  # the rank's process: a child it forks shares none of the tray's connections
        # the timeout of barriers without one of their own (programs' barrier ops, rank.barrier()), s:
        # the launch's or the environment's (TRAY_BARRIER_TIMEOUT_S), else the manifest's, else the default
        self.barrier_timeout_s = wiring.env.barrier_wait_s(wiring.manifest.barrier_timeout_s)
        _report_uncaught(self)

    # --- what start-up made ------------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        return self._wiring.backend

    @property
    def manifest(self) -> Manifest:
        return self._wiring.manifest

    @property
    def resolved(self) -> ResolvedManifest:
        return self._wiring.resolved

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per start-up phase (import, manifest, device, allocate, offer, table, ...); after `close()`,
        also per step of it ("close.programs", "close.collectives", "close.backend", ...)."""
        return self._wiring.phases.timings

    @property
    def phase(self) -> str:
        """Where this rank is: a start-up phase, "running", or "closed" after close()."""
        return "closed" if self._closed else self._wiring.phases.current

    def context(self) -> RankContext:
        """What the executor, parking and weight loading use of this rank."""
        self._require_open("context()")
        self._require_own_process("context()")
        return RankContext(self._wiring, self.kernel, self._exchange)

    # --- the API -----------------------------------------------------------------------------------
    def _require_open(self, what: str) -> None:
        if self._closed:
            raise UsageError(f"rank {self.rank}: {what} after close()")

    def _forked(self) -> bool:
        """Whether this is a child the rank's process forked after tray.init() (a DataLoader worker, a fork Pool's)."""
        return _forked_after_init and os.getpid() != self._pid

    def _require_own_process(self, what: str, name: object = None) -> None:
        """The steps that talk to the head or to the peers (barriers, exchange, collectives, programs, park/wake) are
        the rank's process's: in a forked child its head socket has no I/O thread (a wait there never ends) and a
        barrier would bump the peers' flags for an epoch the rank never entered. UsageError there, at once. `what`
        is the call, `name` its argument when it has one (formatted only then: these calls are the hot ones)."""
        if self._forked():
            call = what if name is None else f"{what}({name!r})"
            raise UsageError(_forked_child(f"{call} in process {os.getpid()}", self._pid, self.rank))

    def buffer(self, name: str) -> BufferView:
        """The manifest buffer `name` on this rank: `.ptr`, and a zero-copy tensor (`torch.from_dlpack`,
        `np.from_dlpack`; see tray.rank.views) typed and shaped as the manifest says."""
        self._require_open(f"buffer({name!r})")
        b = self._wiring.buffer(name_arg("buffer()", "the buffer", name))
        return BufferView(b.name, b.dtype, b.shape, b.nbytes, b.ptr, b.export, self.rank, self.backend,
                          self._wiring.buffers[name], self._leases)

    def peer_view(self, name: str, member: int) -> BufferView:
        """Global rank `member`'s copy of exported buffer `name`, mapped here: a zero-copy tensor on THIS
        rank's device (cuda: this GPU's ordinal), typed and shaped as the manifest says. `member` must be
        in the buffer's group; this rank's own gives its own buffer. The mapping stays while a view of it
        lives, even past close(). Raises UsageError for an unknown buffer or member, or after close()."""
        self._require_open(f"peer_view({name!r}, {member})")
        name_arg("peer_view()", "the buffer", name)
        # a numpy integer, a one-element integer tensor: the rank it holds; a bool, a float, an array: no rank
        member = int_arg(f"peer_view({name!r}, member)", "member (a global rank)", member)
        table = self.peers(name)
        check_member(name, member, table.group.members, table.group.name)
        b = self._wiring.buffer(name)
        resource = self._wiring.buffers[name] if member == self.rank else self._wiring.mappings[(member, name)]
        return BufferView(b.name, b.dtype, b.shape, b.nbytes, table.ptrs[table.group.members.index(member)],
                          b.export, member, self.backend, resource, self._leases)

    def peers(self, name: str) -> PeerTable:
        """Every member's address of exported buffer `name` (over the buffer's group)."""
        self._require_open("peers()")
        return self._wiring.peers(name_arg("peers()", "the buffer", name))

    def group(self, name: str = "world") -> GroupInfo:
        """This rank's instance of group `name`: `.members` (global ranks, member order), `.index`, `.size`."""
        self._require_open(f"group({name!r})")
        return self._wiring.group(name_arg("group()", "the group", name))

    def barrier(self, group: str = "world", timeout_s: float | None = None, stream: int | None = None) -> None:
        """Wait until every member of `group` arrives; BarrierTimeout names who did not. `timeout_s` None:
        the rank's `barrier_timeout_s` (TRAY_BARRIER_TIMEOUT_S, else the manifest's, else 2 s).

        With `stream` (an int handle, e.g. `torch.cuda.current_stream().cuda_stream`) the barrier is only
        enqueued on that stream (no sync, no allocation: a CUDA graph capture on it records the barrier);
        a timeout then surfaces at the next `synchronize()` after that stream's work ended."""
        timeout_s = self.barrier_timeout_s if timeout_s is None else seconds_arg(f"barrier({group!r})", timeout_s)
        if stream is not None:
            stream = stream_arg(f"barrier({group!r})", stream)
        if stream is None:
            self.barrier_of(group).wait(timeout_s)
        else:
            self.barrier_of(group).launch(timeout_s, stream)

    def barrier_of(self, group: str = "world") -> Barrier:
        """The group's Barrier object, for launching without synchronising (benchmarks, graphs)."""
        self._require_open("barrier()")
        self._require_own_process("barrier", group)
        return self._wiring.barrier(name_arg("barrier()", "the group", group))

    def kernel(self, name: str) -> Kernel:
        """The manifest kernel `name`, compiled and loaded once (host: its numpy twin)."""
        self._require_open(f"kernel({name!r})")
        name_arg("kernel()", "the kernel", name)
        if name not in self._kernels:
            spec = next((k for k in self.manifest.kernels if k.name == name), None)
            if spec is None:
                known = sorted(k.name for k in self.manifest.kernels)
                raise UsageError(f"no kernel {name!r} in {self._wiring.manifest_said()}; it declares "
                                 f"{known_list(known)}{did_you_mean(name, known)}")
            self._kernels[name] = self.backend.load_kernel(spec.name, spec.code, spec.entry, spec.options,
                                                           spec.peers, filename=os.path.basename(spec.source))
        return self._kernels[name]

    def collectives(self, group: str = "world") -> Collectives:
        """The collectives of `group`. The first call joins every group's collectives: a tray-wide step
        that every rank must make (like `exchange`); a program with a collective op makes it in lockstep."""
        self._require_open("collectives()")
        self._require_own_process("collectives", group)
        return self._wiring.collectives_of(name_arg("collectives()", "the group", group), self._exchange)

    def read(self, name: str) -> np.ndarray:
        """A host copy of buffer `name`, typed and shaped as the manifest says."""
        self._require_open(f"read({name!r})")
        b = self.buffer(name)
        return self.backend.read(b.ptr, b.nbytes).view(numpy_dtype(b.dtype)).reshape(b.shape)

    def write(self, name: str, data: np.ndarray) -> None:
        """Copy `data` into buffer `name` from offset 0: of the buffer's dtype, or its raw bits (an integer array of
        the element's size, e.g. bf16 as uint16, or uint8); its bytes must fit. Raises UsageError otherwise (float64
        data into an f32 buffer would have stored its bytes unconverted)."""
        self._require_open(f"write({name!r})")
        b = self.buffer(name)
        if not isinstance(data, np.ndarray) and callable(getattr(data, "data_ptr", None)):
            # a tensor: numpy cannot take every dtype (bf16) nor device memory; the buffer's view can
            raise UsageError(f"write({name!r}): takes numpy data, got a {type(data).__name__}; copy a tensor into the "
                             f"buffer's view instead: torch.from_dlpack(rank.buffer({name!r})).copy_(tensor)")
        try:
            arr = np.ascontiguousarray(data)
        except (TypeError, ValueError) as exc:  # ragged nested lists, objects numpy cannot make an array of
            raise UsageError(f"write({name!r}): takes a numpy array (or what np.asarray makes one of), got a "
                             f"{type(data).__name__} numpy refuses ({exc}); pass an array of the buffer's dtype "
                             f"{b.dtype} or its raw bits") from None
        want = numpy_dtype(b.dtype)
        # NOTE: raw bits are fine: an integer array of the element's size (bf16 as uint16; bool as u8), or bytes
        raw = arr.dtype == np.uint8 or (arr.dtype.kind in "uib" and arr.dtype.itemsize == want.itemsize)
        if arr.dtype != want and not raw:
            raise UsageError(f"write({name!r}): {arr.dtype} data into a {b.dtype} buffer would store its bytes "
                             f"unconverted; convert it first (np.asarray(data, {want.name!r})), or pass the raw bits "
                             f"as an integer array of {want.itemsize} B per element or as uint8")
        if arr.nbytes > b.nbytes:
            raise UsageError(f"write({name!r}): {arr.nbytes} B ({arr.size} x {arr.dtype}) do not fit buffer "
                             f"{name!r} of {b.nbytes} B ({b.dtype}{list(b.shape)})")
        self.backend.write(b.ptr, arr)

    def exchange(self, topic: str, value: Any, timeout_s: float = 60.0) -> list[Any]:
        """Every rank's `value` (msgpack-able), in rank order, through the head. A tray-wide step:
        every rank must call it with the same topic. Raises UsageError, before sending, when the
        value is larger than wire.vote_limit_nbytes(world_size) (all values travel back in one message), or
        when the topic is one of tray's own (`tray:...`, tray.collectives.join, tray.park)."""
        name_arg("exchange()", "the topic", topic)
        if topic.startswith("tray:") or topic in (JOIN_TOPIC, PARK_TOPIC):  # GROUP_PREFIX is tray:group:
            raise UsageError(f"exchange({topic!r}): topics beginning with 'tray:', and {JOIN_TOPIC!r} and "
                             f"{PARK_TOPIC!r}, are tray's own steps; choose another topic")
        return self._exchange(topic, value, timeout_s)

    def _exchange(self, topic: str, value: Any, timeout_s: float = 60.0) -> list[Any]:
        """exchange() for tray's own steps too (the collectives' join, park and wake)."""
        self._require_open("exchange()")
        self._require_own_process("exchange", topic)
        timeout_s = wire.step_wait(timeout_s, f"exchange({topic!r})")
        client = self._wiring.client
        rnd = self._rounds.next(topic)
        try:
            data = wire.encode(wire.Vote(token=self.env.token, rank=self.rank, topic=topic, round=rnd, value=value,
                                         wait_s=timeout_s))
        except WireError as exc:  # the caller's value: too large for one message, or of a type msgpack lacks
            raise UsageError(f"exchange({topic!r}): its value cannot be sent ({exc.reason}); values are None, bool, "
                             "int, float, str, bytes, and lists and dicts (str keys) of them (a numpy or torch value: "
                             "its .item() or .tolist()), within "
                             f"{wire.vote_limit_nbytes(self.world_size)} B per rank") from None
        limit = wire.vote_limit_nbytes(self.world_size)
        if len(data) > limit:
            raise UsageError(
                f"exchange({topic!r}): rank {self.rank}'s value takes {len(data)} B; the head sends every "
                f"rank's value back in one message of at most {wire.job_message_limit(self.world_size)} B, so each of "
                f"the {self.world_size} ranks may send at most {limit} B: exchange less (e.g. a digest or a path)")
        with client.step("exchange", topic):
            self._rounds.begin(topic, rnd)
            client.send_bytes(data)
            try:
                since = time.monotonic()  # one deadline: a stale decision skipped does not restart the wait
                while True:
                    d = client.receive(wire.Decision, timeout_s, f"decision on {describe_step(topic)}", since)
                    if d.topic == topic and d.round == rnd:
                        return list(d.values)
                    self._rounds.skipped(d.topic, d.round)  # stale: a decision of a step this rank gave up
            except BaseException:
                self._rounds.gave_up(topic, rnd)
                raise

    # --- programs, weights and park/wake (tray/rank/executor.py, tray/weights/, tray/park/) ----------
    def run(self, program: str, vars: dict[str, int] | None = None, stream: int | None = None) -> None:
        """Run manifest program `program` in lockstep with every rank (arguments resolved once per
        (program, vars), then replayed; `graph: true` programs replay one captured graph).

        With `stream` (an int handle) the program runs after the work on that stream and before the next
        (see tray.rank.streams); run it once outside a capture first (plans and kernels are built then)."""
        self._require_open("run()")
        self._require_own_process("run", program)
        name_arg("run()", "the program", program)
        if vars is not None and not isinstance(vars, dict):
            raise UsageError(f"run({program!r}): vars is a dict of var name -> int, got a {type(vars).__name__}")
        checked: dict[str, int] = {}
        for key, value in (vars or {}).items():
            if type(key) is str and type(value) is int:  # the common case, without formatting a message
                checked[key] = value
                continue
            name_arg(f"run({program!r})", "a key of vars (a var of the manifest)", key)
            checked[key] = int_arg(f"run({program!r})", f"var {key!r}", value)
        vars = checked
        if stream is not None:
            stream = stream_arg(f"run({program!r})", stream)
        if self._executor is None:
            from tray.rank.executor import Executor

            self._executor = Executor(self.context(), self.barrier_timeout_s)
        if stream is None:
            self._executor.run(program, vars or {})
        else:
            from tray.rank.streams import run_on_stream

            run_on_stream(self.backend, self._executor.plan(program, vars or {}), stream)

    def synchronize(self) -> None:
        """Wait for this rank's stream; raise BarrierTimeout if a barrier it ran timed out."""
        self._require_open("synchronize()")
        self.backend.synchronize()
        for barrier in self._wiring.barriers.values():
            barrier.check()

    def load_weights(self, *, staging_nbytes: int | None = None, progress: bool = True) -> WeightsReport:
        """Fill every buffer whose manifest entry has a `bind` from its safetensors file (pread into
        pinned double buffers, copied while the next read runs; `staging_nbytes` each, None: the default).
        Returns a tray.weights.WeightsReport."""
        from tray.weights import load_weights
        from tray.weights.loader import DEFAULT_STAGING_NBYTES

        staging = DEFAULT_STAGING_NBYTES if staging_nbytes is None else \
            int_arg("load_weights()", "staging_nbytes", staging_nbytes)
        if staging < 1:
            raise UsageError(f"load_weights(): staging_nbytes must be >= 1 (bytes per staging buffer; leave it out "
                             f"for {DEFAULT_STAGING_NBYTES}), got {staging}")
        if progress is not None and not isinstance(progress, (bool, int, np.bool_)):
            raise UsageError(f"load_weights(): progress is a bool (print the progress line or not; None: not), got "
                             f"{shown(progress)}")
        return load_weights(self.context(), staging_nbytes=staging, progress=bool(progress))

    def _parking(self) -> Parking:
        self._require_open("park/wake")
        self._require_own_process("park/wake/lease")
        if self._park is None:
            from tray.park import Parking

            self._park = Parking(self.context())
        return self._park

    def lease(self, pages: int, state: str | None = None) -> Session:
        """Lease `pages` device pages of `state` (default: the manifest's only state) on this rank."""
        if state is not None:
            name_arg("lease()", "the state", state)
        return self._parking().lease(int_arg("lease()", "pages", pages), state)

    def park(self, session: Session) -> ParkedSession:
        """Tray-wide: move every rank's pages of `session` to host memory, all or nothing (NoRoom)."""
        return self._parking().park(session)

    def wake(self, parked: ParkedSession) -> Session:
        """Tray-wide: bring a parked session back to device pages on every rank, all or nothing."""
        return self._parking().wake(parked)

    # --- ending --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Say bye to the head (from here on it does not expect heartbeats: the program may go on without the
        tray) and release everything this rank made, in reverse order. Every step runs even when one raises;
        the first failure is raised at the end."""
        if self._closed:
            return
        self._closed = True
        if self._forked():
            # a forked child (leaving the `with` block, sys.exit in a worker): the tray, its socket and its memory are
            # the rank's; the child neither says bye for it nor releases them (its copies go with the process)
            return
        if not self._reported:
            try:
                # NOTE: a step another thread of the rank waits in ends first (a UsageError there): the socket is not
                # shared between threads
                self._wiring.client.send_last(wire.Bye(token=self.env.token, rank=self.rank))
            except Exception:  # NOTE: a head that is gone needs no bye; the rank still releases what it holds
                pass
        failures: list[BaseException] = []

        def attempt(step: Callable[[], object]) -> None:
            try:
                step()
            except BaseException as exc:  # NOTE: re-raised below, once everything had its chance to close
                failures.append(exc)

        t0 = time.perf_counter()
        for owner in (self._executor, self._park):
            if owner is not None:
                attempt(owner.close)
        attempt(lambda: self._leases.close(self.backend))  # memory a live view uses stays mapped until the view goes
        self._wiring.phases.timings["close.programs"] = time.perf_counter() - t0
        attempt(self._wiring.close)
        for name, kernel in self._kernels.items():  # a kernel kept past close() says so, not a launch on freed memory
            seal_kernel(kernel, name)
        if failures:
            raise failures[0]

    def __enter__(self) -> Rank:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._forked():  # a forked child's exception is its own, not the rank's report (nor its error file)
            self._closed = True
            return
        if exc is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            _report(self.env, self.phase, self._wiring.client, exc)
            self._reported = True
        elif isinstance(exc, SystemExit) and exc.code not in (None, 0):
            self._reported = True  # no bye: the head names the exit code, in the phase the rank left from
        elif isinstance(exc, KeyboardInterrupt):
            # no bye either: the rank is being interrupted (uncaught, it ends by SIGINT), not leaving the tray; the head
            # names the signal, or takes it for the whole tray's Ctrl-C when it got one too
            self._reported = True
        self.close()


def _forked_child(what: str, owner: int, rank: int | None = None) -> str:
    """Why a forked child of a rank may not use the tray: `what` it did, `owner` the rank's process."""
    whose = f"rank {rank}'s" if rank is not None else "the rank's"
    return (f"{what}, a child that {whose} process ({owner}) forked after tray.init() (a DataLoader worker, a "
            "multiprocessing fork Pool's): the tray's connection to the head, its heartbeats and its barriers belong "
            f"to process {owner}, and in a forked child a wait on them would never end or a barrier would count for "
            "the rank; make those calls in the rank's process and hand the child what it needs")


def _error_report(env: RankEnv, phase: str, exc: BaseException) -> wire.ErrorReport:
    tb = "".join(traceback.format_exception(exc))
    # NOTE: control messages are capped at 1 MiB; keep the traceback's end, where the cause is.
    tb = tb if len(tb) <= 64_000 else "...\n" + tb[-64_000:]
    return wire.ErrorReport(token=env.token, rank=env.rank, phase=phase, error_type=type(exc).__name__,
                            message=str(exc)[:16_000], traceback=tb)


def _write_error_file(env: RankEnv, report: wire.ErrorReport, kind: str = "error") -> bool:
    """`report` as the file `rank-R.<kind>.json` in the job dir, which the head reads when the rank dies: "error",
    why it fails; "logged", the last exception the program logged through sys.excepthook. False if not written."""
    try:
        path = Path(env.job_dir) / f"rank-{env.rank}.{kind}.json"
        tmp = path.with_suffix(".tmp")
        data = json.dumps({"rank": report.rank, "phase": report.phase, "error_type": report.error_type,
                           "message": report.message, "traceback": report.traceback}).encode()
        # NOTE: never through a link planted at the name: the file is the rank's own, 0600; O_NONBLOCK: a FIFO planted
        # there would block the open (no reader) and the failing rank with it, its heartbeats going on
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{tmp} is not a regular file")
            os.set_blocking(fd, True)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        tmp.replace(path)
        return True
    except OSError:
        return False


def _report(env: RankEnv, phase: str, client: Any, exc: BaseException) -> None:
    """Tell the head why this rank fails: an error file (survives a dead socket) and a message."""
    report = _error_report(env, phase, exc)
    sent = False
    written = _write_error_file(env, report)
    if client is not None:
        try:
            # the rank's last message: a step another thread waits in ends first (a UsageError there), so that the
            # report does not share the socket with it
            sent = client.send_last(report)
        except Exception:  # the head may be gone; the error file stays
            pass
    # NOTE: a message to a head whose job dir (its socket's) is gone may sit queued, never delivered: only then is
    # the traceback left to the head; else this process prints it, as any uncaught exception
    if written or (sent and os.path.isdir(env.job_dir)):
        _print_once(exc, env.rank)


def _report_uncaught(rank: Rank) -> None:
    """An exception that ends the rank's process uncaught while its Rank is open is reported to the head, as one that
    leaves `with tray.init() as rank:` is: a program that keeps the Rank without `with` (`rank = tray.init()` at its
    top, as scripts under torchrun do), a second tray.init(). The head then names it as the rank's failure, where it
    said only "exited with code 1"."""
    previous = sys.excepthook
    owner = weakref.ref(rank)

    def hook(kind, value, tb) -> None:
        r = owner()
        if (r is None or r._closed or r._reported or os.getpid() != r._pid or not isinstance(value, Exception)
                or threading.current_thread() is not threading.main_thread()):
            # a child's, one reported already, an exit or an interruption; or not the end of the process (another
            # thread's, passed here by a threading.excepthook)
            previous(kind, value, tb)
            return
        if _program_running(sys._getframe(0).f_code):
            # a caught one the program logs through the hook: it may go on (not the rank's failure), or exit next
            # (sys.exit(1), os._exit(1), a runner such as coverage's): the head names it then, from this file
            with contextlib.suppress(Exception):
                _write_error_file(r.env, _error_report(r.env, r.phase, value), "logged")
            previous(kind, value, tb)
            return
        r._reported = True  # no bye: the report is the rank's last message
        try:
            _report(r.env, r.phase, r._wiring.client, value)
        except Exception:  # NOTE: the process ends now whatever: the traceback below says it
            pass
        (sys.excepthook if sys.excepthook is not hook else previous)(kind, value, tb)  # one line once reported

    sys.excepthook = hook


def _program_running(own: types.CodeType) -> bool:
    """Whether the program's own code is still on this thread's stack below the excepthook (`own`, the hook's code):
    it called the hook itself to log an exception it caught (from its module, a function, an atexit handler or a
    greenlet), and may go on. An exception that ends the process reaches the hook from the interpreter, which calls
    sys.excepthook with no frame of the program's left: the stack's first frame is then a hook's (this one, or the one
    the program set, which calls it)."""
    frame = sys._getframe()
    while frame.f_back is not None:
        frame = frame.f_back
    return frame.f_code is not own and frame.f_code is not _code_of(sys.excepthook)


def _code_of(fn: object) -> types.CodeType | None:
    """The code the interpreter runs first when it calls `fn`: a function's, and through what wraps one (a bound or
    static method, functools.partial, a decorator that sets __wrapped__, lru_cache), or a callable object's __call__
    or a class's __init__; None for a builtin, or where that cannot be told."""
    try:
        for _ in range(16):  # wrappers of wrappers: a few layers at most
            if isinstance(fn, types.FunctionType):
                return fn.__code__
            if isinstance(fn, functools.partial):
                fn = fn.func
            elif isinstance(fn, (types.MethodType, staticmethod, classmethod)):
                fn = fn.__func__
            elif getattr(fn, "__wrapped__", None) is not None:
                fn = fn.__wrapped__  # type: ignore[attr-defined]
            elif isinstance(fn, type):
                fn = fn.__init__  # type: ignore[misc]
            elif isinstance(type(fn).__call__, types.FunctionType):  # type: ignore[operator]
                fn = type(fn).__call__  # type: ignore[operator]
            else:
                return None
    except Exception:  # NOTE: a hook of any kind (a dead weakref.proxy raises on every attribute): not told
        return None
    return None


def _print_once(reported: BaseException, rank: int) -> None:
    """The head prints a reported exception's traceback (its root cause, and --log-dir files); should the
    exception end this process uncaught, print one line instead of a second copy of the traceback."""
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:
        if value is reported:
            first = str(value).splitlines()[0] if str(value) else ""
            print(f"rank {rank}: {kind.__name__}: {first} (reported to the head, which says it first)",
                  file=sys.stderr, flush=True)
        else:
            previous(kind, value, tb)

    sys.excepthook = hook
