"""The head: spawn the ranks, run the rendezvous (ROUTER), coordinate votes, supervise, tear down.

The first failure (exit code, signal, error report, missed heartbeat, handshake timeout) is the root
cause; the head stops every other rank, prints the root cause first and exits non-zero.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import zmq

from tray.collectives import SHM_PATTERNS
from tray.errors import WireError
from tray.handshake import wire
from tray.handshake.validate import validate_offers
from tray.launch.jobdir import make_job_dir
from tray.launch.spawn import rank_env, spawn_rank, start_pumps
from tray.launch.spec import Failure, RankProcess, RankState, TrayResult, TraySpec
from tray.manifest import Manifest, builtin_manifest, load_manifest
from tray.numa import NumaPlacement, placement_for

EXIT_RANK_FAILED = 1
EXIT_HANDSHAKE = 3
_POLL_MS = 20
PHASES = ("spawn", "import", "device", "manifest", "allocate", "offer", "table", "import_peers", "join",
          "ready")


def _say(msg: str) -> None:
    print(f"tray: {msg}", file=sys.stderr, flush=True)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _init_driver() -> None:
    from tray.backend.cuda import visible_gpu_count

    visible_gpu_count()


def _collectives_shm() -> set[str]:
    """The collectives' shared-memory segments of this uid (a rank killed mid-run cannot unlink its own)."""
    root = Path("/dev/shm")
    try:
        return {str(p) for pattern in SHM_PATTERNS for p in root.glob(pattern) if p.stat().st_uid == os.getuid()}
    except OSError:
        return set()


def _remove_orphaned_shm(candidates: set[str]) -> None:
    """Unlink segments that appeared during this tray and that no live process of ours still maps."""
    if not candidates:
        return
    in_use: set[str] = set()
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != os.getuid():
                continue
            in_use.update(m.path for m in proc.memory_maps(grouped=True) if m.path in candidates)
            in_use.update(f.path for f in proc.open_files() if f.path in candidates)
        except (psutil.Error, OSError):
            continue
    for path in candidates - in_use:
        try:
            os.unlink(path)
        except OSError:
            pass


class Head:
    """One tray launch. `run()` returns a TrayResult and leaves no process, socket or job dir."""

    def __init__(self, spec: TraySpec, placements: list[NumaPlacement] | None = None) -> None:
        self.spec = spec
        self.manifest: Manifest = load_manifest(spec.manifest) if spec.manifest else builtin_manifest()
        self.resolved = self.manifest.resolve(spec.nprocs, dict(spec.vars))
        self.placements = placements or [placement_for(None)] * spec.nprocs
        self.token = secrets.token_hex(16)
        self.procs: list[RankProcess] = []
        self.offers: dict[int, wire.Offer] = {}
        self.ready: dict[int, wire.Ready] = {}
        self.votes: dict[tuple[str, int], dict[int, object]] = {}
        self.failure: Failure | None = None
        self.rejected: list[str] = []
        self.t_go: float | None = None
        self.t_table: float | None = None
        self.handshake_done = False

    # --- lifecycle ------------------------------------------------------------------------------
    def run(self) -> TrayResult:
        shm_before = _collectives_shm()
        job_dir = make_job_dir()
        endpoint = f"ipc://{job_dir}/head.sock"
        ctx = sock = None
        try:
            t0 = time.time()
            self._spawn_all(job_dir, endpoint)
            self.t_spawned = time.time() - t0
            if self.spec.backend == "cuda":
                # NOTE: with the driver initialised in a live process (here, the head), each rank's
                # cuInit + context costs ~0.7 s instead of ~1.5 s (measured on 4x H200, no persistence
                # daemon). Started after the spawn: no thread may exist while ranks are forked.
                threading.Thread(target=_init_driver, name="tray-driver", daemon=True).start()
            ctx = zmq.Context()
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.bind(endpoint)
            os.chmod(job_dir / "head.sock", 0o600)
            self._loop(sock, job_dir)
        finally:
            self._teardown()
            if self.failure is not None:
                _remove_orphaned_shm(_collectives_shm() - shm_before)
            if sock is not None:
                sock.close()
            if ctx is not None:
                ctx.term()
            shutil.rmtree(job_dir, ignore_errors=True)
        return self._result(job_dir)

    def _spawn_all(self, job_dir: Path, endpoint: str) -> None:
        manifest = str(Path(self.spec.manifest).resolve()) if self.spec.manifest else ""
        for r in range(self.spec.nprocs):
            t_spawn = time.time()
            env = rank_env(self.spec, r, job_dir=job_dir, endpoint=endpoint, token=self.token,
                           manifest=manifest, t_spawn=t_spawn)
            proc = spawn_rank(self.spec, r, env, self.placements[r])
            self.procs.append(proc)
        for proc in self.procs:
            proc.pumps = start_pumps(proc, self.spec.log_dir, self.spec.quiet)

    def _loop(self, sock: zmq.Socket, job_dir: Path) -> None:
        t_start = time.monotonic()
        while True:
            while sock.poll(_POLL_MS if not self.failure else 0, zmq.POLLIN):
                ident, payload = self._recv(sock)
                if ident is not None:
                    self._on_message(sock, ident, payload)
                if self.failure:
                    return
            self._check_children(sock, job_dir)
            if self.failure:
                return
            self._check_deadlines(time.monotonic() - t_start)
            if self.failure:
                return
            if all(p.returncode is not None for p in self.procs):
                return

    def _recv(self, sock: zmq.Socket) -> tuple[str | None, bytes]:
        frames = sock.recv_multipart()
        if len(frames) != 2:
            self._reject_log(frames[0].decode(errors="replace"), f"expected 1 frame, got {len(frames) - 1}")
            return None, b""
        return frames[0].decode(errors="replace"), frames[1]

    # --- messages -------------------------------------------------------------------------------
    def _sender_rank(self, ident: str) -> int | None:
        base = ident[:-3] if ident.endswith(".hb") else ident
        if base.startswith("rank-") and base[5:].isdigit() and int(base[5:]) < self.spec.nprocs:
            return int(base[5:])
        return None

    def _reject_log(self, ident: str, reason: str) -> None:
        line = f"rejected a message from {ident}: {reason}"
        self.rejected.append(line)
        _say(line)

    def _on_message(self, sock: zmq.Socket, ident: str, payload: bytes) -> None:
        rank = self._sender_rank(ident)
        try:
            msg = wire.decode(payload, token=self.token, sender=ident)
        except WireError as exc:
            self._reject_log(ident, exc.reason)
            self._send(sock, ident, wire.Reject(token=self.token, reason=exc.reason))
            return
        if rank is None or getattr(msg, "rank", rank) != rank:
            reason = f"identity {ident!r} does not match the rank it claims ({getattr(msg, 'rank', None)})"
            self._reject_log(ident, reason)
            self._send(sock, ident, wire.Reject(token=self.token, reason=reason))
            return
        proc = self.procs[rank]
        if isinstance(msg, wire.Heartbeat):
            proc.last_heartbeat = time.monotonic()
            proc.phase = msg.phase
        elif isinstance(msg, wire.Offer):
            self._on_offer(sock, proc, msg)
        elif isinstance(msg, wire.Ready):
            self.ready[rank] = msg
            proc.state = RankState.READY
            if len(self.ready) == self.spec.nprocs:
                self.t_go = time.time()
                for p in self.procs:
                    p.state = RankState.RUNNING
                    self._send(sock, f"rank-{p.rank}", wire.Go(token=self.token, t_go=self.t_go))
                self._print_timeline()
        elif isinstance(msg, wire.ErrorReport):
            self._fail(Failure(rank, f"rank {rank} reported {msg.error_type}: {msg.message}",
                               report=f"phase {msg.phase}\n{msg.traceback}", tail=tuple(proc.tail)))
        elif isinstance(msg, wire.Vote):
            self._on_vote(sock, msg)
        elif isinstance(msg, wire.Bye):
            proc.phase = "bye"
        else:
            self._reject_log(ident, f"a rank may not send {msg.KIND!r}")

    def _on_offer(self, sock: zmq.Socket, proc: RankProcess, offer: wire.Offer) -> None:
        if proc.rank in self.offers:
            self._reject_log(f"rank-{proc.rank}", "a second offer")
            return
        self.offers[proc.rank] = offer
        proc.state = RankState.OFFERED
        if len(self.offers) < self.spec.nprocs:
            return
        leaders = {name: [members[0] for members in instances] for name, instances in self.resolved.groups.items()}
        problems = validate_offers(
            [self.offers[r] for r in range(self.spec.nprocs)], world_size=self.spec.nprocs,
            digest=self.manifest.digest, uid=os.getuid(), pids={p.rank: p.pid for p in self.procs},
            group_leaders=leaders,
        )
        if problems:
            self._fail(Failure(None, "the offers disagree; nobody proceeds:\n  " + "\n  ".join(problems),
                               exit_code=EXIT_HANDSHAKE))
            return
        self.t_table = time.time()
        table = wire.Table(token=self.token, offers=tuple(self.offers[r] for r in range(self.spec.nprocs)))
        for p in self.procs:
            self._send(sock, f"rank-{p.rank}", table)

    def _on_vote(self, sock: zmq.Socket, vote: wire.Vote) -> None:
        key = (vote.topic, vote.round)
        box = self.votes.setdefault(key, {})
        box[vote.rank] = vote.value
        if len(box) == self.spec.nprocs:
            del self.votes[key]
            decision = wire.Decision(token=self.token, topic=vote.topic, round=vote.round,
                                     values=tuple(box[r] for r in range(self.spec.nprocs)))
            for p in self.procs:
                self._send(sock, f"rank-{p.rank}", decision)

    def _send(self, sock: zmq.Socket, ident: str, msg: object) -> None:
        try:
            sock.send_multipart([ident.encode(), wire.encode(msg)])
        except zmq.ZMQError as exc:  # the rank is gone; its exit is the failure we report
            _say(f"could not send {getattr(msg, 'KIND', '?')} to {ident}: {exc}")

    # --- supervision ----------------------------------------------------------------------------
    def _check_children(self, sock: zmq.Socket, job_dir: Path) -> None:
        for p in self.procs:
            if p.returncode is not None:
                continue
            code = p.popen.poll()
            if code is None:
                continue
            p.returncode = code
            p.state = RankState.EXITED if code == 0 else RankState.FAILED
            if code == 0:
                if self.offers and not self.t_go:
                    self._fail(Failure(p.rank, f"rank {p.rank} exited with code 0 before the handshake "
                                       f"completed (last phase: {p.phase})", tail=tuple(p.tail)))
                continue
            # drain messages first: the rank's error report may still be in flight
            while sock.poll(0, zmq.POLLIN) and not self.failure:
                ident, payload = self._recv(sock)
                if ident is not None:
                    self._on_message(sock, ident, payload)
            if self.failure:
                return
            how = f"exited with code {code}" if code > 0 else f"was killed by {_signal_name(code)}"
            report = self._error_file(job_dir, p.rank)
            self._fail(Failure(p.rank, f"rank {p.rank} (pid {p.pid}) {how} (last phase: {p.phase})",
                               report=report, tail=tuple(p.tail)))
            return

    def _error_file(self, job_dir: Path, rank: int) -> str:
        path = job_dir / f"rank-{rank}.error.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return ""
        return f"{data.get('error_type')}: {data.get('message')}\n{data.get('traceback', '')}"

    def _check_deadlines(self, elapsed_s: float) -> None:
        now = time.monotonic()
        heard = bool(self.offers) or any(p.last_heartbeat is not None for p in self.procs)
        if heard and not self.t_go and elapsed_s > self.spec.handshake_timeout_s:
            missing = [p for p in self.procs if p.rank not in self.offers] or \
                      [p for p in self.procs if p.rank not in self.ready]
            what = "offer" if len(self.offers) < self.spec.nprocs else "report ready"
            names = "; ".join(
                f"rank {p.rank} did not {what} within {self.spec.handshake_timeout_s:.0f} s "
                f"(process {'alive' if p.popen.poll() is None else 'dead'}, last phase: "
                f"{p.phase if p.last_heartbeat is not None else 'spawn: never contacted the head'})"
                for p in missing)
            self._fail(Failure(missing[0].rank if missing else None, names, exit_code=EXIT_HANDSHAKE,
                               tail=tuple(missing[0].tail) if missing else ()))
            return
        for p in self.procs:
            if p.returncode is None and p.last_heartbeat is not None and p.phase != "bye":
                silent = now - p.last_heartbeat
                if silent > self.spec.heartbeat_timeout_s:
                    self._fail(Failure(p.rank, f"rank {p.rank} (pid {p.pid}) sent no heartbeat for "
                                       f"{silent:.1f} s (timeout {self.spec.heartbeat_timeout_s:.1f} s, "
                                       f"last phase: {p.phase}): stopped or frozen", tail=tuple(p.tail)))
                    return

    def _fail(self, failure: Failure) -> None:
        if self.failure is None:
            self.failure = failure

    def _teardown(self) -> None:
        alive = [p for p in self.procs if p.popen.poll() is None]
        descendants: dict[int, psutil.Process] = {}
        for p in self.procs:
            try:
                for child in psutil.Process(p.pid).children(recursive=True):
                    descendants[child.pid] = child
            except psutil.Error:
                pass
        if alive:
            if self.failure:
                who = ",".join(str(p.rank) for p in alive)
                _say(f"stopping ranks {who} (SIGTERM, {self.spec.grace_s:.1f} s grace, then SIGKILL)")
            for p in alive:
                p.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.spec.grace_s
            for p in alive:
                try:
                    p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:
                    p.popen.kill()
                    p.popen.wait(timeout=5.0)
        for p in self.procs:
            if p.returncode is None:
                p.returncode = p.popen.wait(timeout=5.0)
        for d in descendants.values():
            try:
                d.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(list(descendants.values()), timeout=2.0)
        for p in self.procs:  # let the last lines reach the terminal before the verdict
            for t in p.pumps:
                t.join(timeout=2.0)
        for p in self.procs:
            for stream in (p.popen.stdout, p.popen.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass

    # --- reporting ------------------------------------------------------------------------------
    def _timeline(self) -> dict[str, tuple[float, int]]:
        out: dict[str, tuple[float, int]] = {"spawn": (self.t_spawned, self.spec.nprocs - 1)}
        for r in range(self.spec.nprocs):
            timings = dict(self.offers[r].timings) if r in self.offers else {}
            if r in self.ready:
                timings.update(self.ready[r].timings)
            for phase, secs in timings.items():
                if phase not in out or secs > out[phase][0]:
                    out[phase] = (secs, r)
        if self.t_go and self.t_table:
            last = max(self.ready, key=lambda r: sum(self.ready[r].timings.values()), default=0)
            out["ready"] = (self.t_go - self.t_table, last)
        return out

    def _print_timeline(self) -> None:
        if self.spec.quiet:
            return
        t0 = min(p.t_spawn for p in self.procs)
        total = (self.t_go or t0) - t0
        tl = self._timeline()
        _say(f"tray up in {total:.3f} s ({self.spec.nprocs} ranks, {self.spec.backend} backend); "
             "slowest rank per phase:")
        for phase in PHASES:
            if phase in tl:
                secs, r = tl[phase]
                _say(f"  {phase:<13}{secs * 1e3:9.1f} ms  rank {r}")

    def _print_root_cause(self) -> None:
        f = self.failure
        assert f is not None
        _say(f"FAILED: {f.summary}")
        if f.report.strip():
            _say("error report:")
            for line in f.report.rstrip().splitlines():
                _say(f"  {line}")
        for (topic, rnd), box in self.votes.items():
            missing = ",".join(str(r) for r in range(self.spec.nprocs) if r not in box)
            _say(f"tray-wide step {topic!r} (round {rnd}) was still waiting for rank {missing}")
        if f.tail:
            _say(f"last lines of rank {f.rank}:")
            for line in f.tail[-10:]:
                _say(f"  | {line}")

    def _result(self, job_dir: Path) -> TrayResult:
        codes = {p.rank: p.returncode for p in self.procs}
        if self.failure:
            self._print_root_cause()
            others = [f"rank {r}: {'killed by ' + _signal_name(c) if c and c < 0 else f'exit {c}'}"
                      for r, c in codes.items() if r != self.failure.rank]
            if others:
                _say("after teardown: " + "; ".join(others))
        t0 = min((p.t_spawn for p in self.procs), default=0.0)
        return TrayResult(
            exit_code=self.failure.exit_code if self.failure else 0, root_cause=self.failure,
            returncodes=codes, timeline=self._timeline() if self.offers else {},
            startup_s=(self.t_go - t0) if self.t_go else None, job_dir=str(job_dir), rejected=self.rejected,
        )


