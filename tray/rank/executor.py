"""The program executor: a manifest program's ops resolved once per (program, vars), then replayed.

Ops (docs/design.md section 7): launch, nccl, gemm, barrier, copy. Every rank runs the same program (the
digest proves it), so the ranks stay in lockstep. `graph: true` captures the whole program into one
graph and replays it; host programs replay their resolved steps the same way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

from tray.backend.base import DEFAULT_BARRIER_TIMEOUT_S, Graph, PtrTable
from tray.backend.wait import Pending
from tray.errors import ManifestError, UsageError
from tray.handshake.steps import spans_nodes
from tray.manifest.schema import (
    BufferRef,
    ResolvedArg,
    ResolvedBarrier,
    ResolvedCollective,
    ResolvedCopy,
    ResolvedGemm,
    ResolvedLaunch,
    ResolvedManifest,
    ResolvedOp,
    ResolvedProgram,
    ResolvedStage,
)
from tray.rank.wiring import RankContext

Step = Callable[[], None]


def describe_op(op: ResolvedOp) -> str:
    """One op in words for a wait that timed out: `nccl alltoall on group 'world' (1024 x u32 per member)`."""
    match op:
        case ResolvedLaunch():
            return f"launch {op.kernel}"
        case ResolvedCollective():
            per = " per member" if op.collective in ("allgather", "reducescatter", "alltoall") else ""
            peer = f" with member i+{op.peer} (mod its size)" if op.peer is not None else ""
            across = f" across {op.across}" if op.across else ""
            return f"nccl {op.collective}{across} on group {op.group!r}{peer} ({op.count} x {op.dtype}{per})"
        case ResolvedGemm():
            return f"gemm {op.m}x{op.n}x{op.k}"
        case ResolvedBarrier():
            return f"barrier {op.group!r}"
        case ResolvedCopy():
            return f"copy {op.nbytes} B"


def program_title(program: str, vars: dict[str, int]) -> str:
    """`program 'dispatch_nccl' (tokens=128)`"""
    shown = ", ".join(f"{k}={v}" for k, v in sorted(vars.items()))
    return f"program {program!r}" + (f" ({shown})" if shown else "")


def spanning_problems(resolved: ResolvedManifest, local_world_size: int,
                      programs: tuple[ResolvedProgram, ...] | None = None) -> list[tuple[str, str]]:
    """Ops of `programs` (default: every program of `resolved`) that cannot run when groups span nodes, as
    (JSON path of the op, what is wrong): launches of `"peers": true` kernels on the peer table of a buffer
    whose group spans nodes (peer tables exist only within a node: no fabric handles between nodes), unless
    the launch stages that table (its "stage": members on other nodes written to a local buffer, carried
    by an alltoall "across": "nodes"). Each problem names the program, the group and what to change. A
    program is checked when it is bound (its first run), so a manifest whose other programs run over such
    a group still launches. (A barrier over such a group is hierarchical, capturable; where it falls back
    to the relayed barrier, a capture of it is refused when it is made: tray/collectives/relay.py.)"""
    problems = []
    kernels = {k.name: k for k in resolved.manifest.kernels}
    for program in resolved.programs.values() if programs is None else programs:
        for op in program.ops:
            if not isinstance(op, ResolvedLaunch):
                continue
            kernel = kernels.get(op.kernel)
            if kernel is None or not kernel.peers:
                continue
            for arg in op.args:
                if arg.kind != "peers" or arg.name is None or op.staged(arg.name) is not None:
                    continue
                group = resolved.buffer(arg.name).group
                spanning = [m for m in resolved.groups[group] if spans_nodes(m, local_world_size)]
                if spanning:
                    problems.append((
                        op.json_path, f"program {program.name!r} launches peers kernel {kernel.name!r} on the peer "
                        f"table of {arg.name!r}, whose group {group!r} spans nodes (instance {list(spanning[0])} with "
                        f"{local_world_size} ranks per node); peer tables exist only within a node: give the buffer a "
                        "group that stays within one node, stage the table for the other nodes (\"stage\" on the "
                        "launch, then an alltoall with \"across\": \"nodes\"), or use a collective"))
    return problems


def _nothing() -> None:
    """The step of an op over a group this rank is in no instance of (docs/manifest.md: no barrier, no
    collectives for that group): nothing."""


# after this many plans (distinct program and vars) a rank says, once, that each is kept for the tray's life
PLANS_SAID_AT = 256


@dataclass
class Plan:
    """A program ready to run: `steps` in order, or one captured `graph` of them. `title` is the program and its
    vars, `ops` each op in words (`describe`, both, is noted in `pending` at each run: a wait that times out
    names it)."""

    program: str
    steps: list[Step]
    title: str  # `program 'go' (count=300)`
    ops: tuple[str, ...]
    graph: Graph | None = None
    pending: Pending | None = None

    @property
    def describe(self) -> str:
        return f"{self.title}: {', '.join(self.ops)}"

    def run(self) -> None:
        if self.pending is not None:
            self.pending.note(self.describe)
        if self.graph is not None:
            self.graph.replay()
            return
        self.run_steps()

    def run_steps(self) -> None:
        """The steps in order; a UsageError of one (a twin past its buffer, say) says which program, with which
        vars, and which op."""
        for i, step in enumerate(self.steps):
            try:
                step()
            except UsageError as exc:
                if type(exc) is not UsageError:  # a kind of its own (CompileError, ...) stays as it is
                    raise
                raise UsageError(f"{self.title}, op {i} ({self.ops[i]}): {exc}") from None

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
            self.graph = None


class Executor:
    """Runs manifest programs for one rank (`ctx`). Plans are cached by (program, vars)."""

    def __init__(self, ctx: RankContext, barrier_timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S) -> None:
        self.ctx = ctx
        self.wiring = ctx.wiring
        self.barrier_timeout_s = barrier_timeout_s
        self._plans: dict[tuple[str, tuple[tuple[str, int], ...]], Plan] = {}
        self._tables: list[PtrTable] = []  # staged peer tables of the plans, closed with them
        self._programmatic = {k.name: k.programmatic for k in ctx.manifest.kernels}

    def run(self, program: str, vars: dict[str, int]) -> None:
        self.plan(program, vars).run()

    def plan(self, program: str, vars: dict[str, int]) -> Plan:
        key = (program, tuple(sorted(vars.items())))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._build(program, vars)
            self._plans[key] = plan
            if len(self._plans) == PLANS_SAID_AT:
                # NOTE: kept for the tray's life (a capture of the caller's may use any of them): a var per request
                # (a token count) grows the rank without end; said once, on stderr, not refused
                warnings.warn(f"rank.run() has built {PLANS_SAID_AT} plans (this one: program {program!r} with "
                              f"{dict(vars)}); each distinct vars keeps its plan (on cuda its graph) for the tray's "
                              "life: give run() sizes from a few buckets, not a value per step", RuntimeWarning,
                              stacklevel=3)
        return plan

    def _resolved_program(self, program: str, vars: dict[str, int]) -> ResolvedProgram:
        ctx = self.ctx
        if not vars:
            return ctx.resolved.program(program)
        ctx.resolved.program(program)  # an unknown name: UsageError naming the manifest's programs
        merged = dict(ctx.wiring.env.vars)
        merged.update(vars)
        local = ctx.wiring.env.local_world_size or None
        # groups and buffers first, no program: a var that would resize a buffer is said as such, not as an op of this
        # program (or of another, which these vars do not concern) overrunning the smaller buffer
        resolved = ctx.manifest.resolve(ctx.world_size, merged, local, programs=())
        for name, instances in resolved.groups.items():
            # groups (barriers, collectives, peer tables) are formed at launch: the ops run over those, so a program
            # checked against other instances could move more than its buffers hold
            if instances != ctx.resolved.groups[name]:
                changed = ", ".join(f"{k}={v}" for k, v in vars.items())
                raise UsageError(
                    f"program {program!r} with {changed}: group {name!r} would be "
                    f"{' '.join(str(list(i)) for i in instances)} but was formed at launch as "
                    f"{' '.join(str(list(i)) for i in ctx.resolved.groups[name])}; set vars that change a group at "
                    "launch (tray launch --var NAME=INT)"
                )
        for b in resolved.buffers:
            if b.nbytes != ctx.resolved.buffer(b.name).nbytes:
                changed = ", ".join(f"{k}={v}" for k, v in vars.items())
                raise UsageError(
                    f"program {program!r} with {changed}: buffer {b.name!r} would need {b.nbytes} B but was "
                    f"allocated with {ctx.resolved.buffer(b.name).nbytes} B; set size-changing vars at launch "
                    "(tray launch --var NAME=INT)"
                )
        return ctx.manifest.resolve(ctx.world_size, merged, local, programs=(program,)).program(program)

    def _build(self, program: str, vars: dict[str, int]) -> Plan:
        """Resolve and bind `program`. Raises ManifestError (before any op runs) where it launches a peers
        kernel over a group that spans nodes (spanning_problems)."""
        resolved = self._resolved_program(program, vars)
        env = self.wiring.env
        if self.wiring.spanning:
            problems = spanning_problems(self.ctx.resolved, env.local_world_size or env.world_size, (resolved,))
            if problems:
                raise ManifestError(self.ctx.manifest.path, problems[0][0], "\n  ".join(w for _, w in problems))
        steps = [self._step(op) for op in resolved.ops]
        plan = Plan(program=program, steps=steps, title=program_title(program, vars),
                    ops=tuple(describe_op(o) for o in resolved.ops), pending=self.ctx.backend.last_work)
        if resolved.graph:
            plan.graph = self.ctx.backend.capture(plan.run_steps)
        return plan

    # --- one op -> one step -------------------------------------------------------------------------
    def _ptr(self, ref: BufferRef) -> int:
        return self.wiring.buffers[ref.name].ptr + ref.offset

    def _step(self, op: ResolvedOp) -> Step:
        match op:
            case ResolvedLaunch():
                kernel = self.ctx.kernel(op.kernel)
                programmatic = self._programmatic.get(op.kernel, False)
                return kernel.bind(op.grid, op.block, [self._arg(a, op) for a in op.args], op.shmem,
                                   programmatic=programmatic).launch
            case ResolvedCollective() if op.group not in self.wiring.groups:
                # a rank in no instance of the group takes no part in its collectives, only in the tray-wide step
                # that joins every group's (made once, by the first collective op of any rank's program)
                self.wiring.collectives.ensure_joined(self.ctx.exchange)
                return _nothing
            case ResolvedCollective():
                return self._collective(op)
            case ResolvedGemm():
                backend = self.ctx.backend
                a, b, c = self._ptr(op.a), self._ptr(op.b), self._ptr(op.c)
                m, n, k, dtype, accumulate = op.m, op.n, op.k, op.dtype, op.accumulate
                return lambda: backend.gemm(a, b, c, m, n, k, dtype, accumulate)
            case ResolvedBarrier() if op.group not in self.wiring.groups:
                return _nothing  # nor in its barrier
            case ResolvedBarrier():
                barrier = self.wiring.barrier(op.group)
                timeout_s = self.barrier_timeout_s
                return lambda: barrier.launch(timeout_s)
            case ResolvedCopy():
                backend = self.ctx.backend
                src, dst, nbytes = self._ptr(op.src), self._ptr(op.dst), op.nbytes
                return lambda: backend.copy(dst, src, nbytes)

    def _arg(self, arg: ResolvedArg, op: ResolvedLaunch) -> int | float:
        if arg.kind == "buffer":
            assert arg.name is not None
            return self.wiring.buffers[arg.name].ptr + arg.offset
        if arg.kind == "peers":
            assert arg.name is not None
            stage = op.staged(arg.name)
            if stage is not None and self.wiring.spec(arg.name).group in self.wiring.spanning:
                return self._staged_table(stage)
            return self.wiring.peers(arg.name).table_ptr
        if arg.kind == "rank":
            return self.ctx.rank
        if arg.kind == "index":
            assert arg.name is not None
            return self.wiring.group(arg.name).index
        return arg.value

    def _staged_table(self, stage: ResolvedStage) -> int:
        """The peer table of `stage.peers` (group spanning nodes) for one launch: this node's members at
        their mappings, each member g on another node at staging + (g - me) * block (ResolvedStage). Made
        once per plan, on the device; closed with the executor."""
        group = self.wiring.group(self.wiring.spec(stage.peers).group)
        node = self.wiring.peer_tables[stage.peers]  # the node's part of the group (lifecycle._mapping_group)
        mapped = dict(zip(node.group.members, node.ptrs))
        base = self._ptr(stage.buffer)
        ptrs = [mapped.get(m, base + (i - group.index) * stage.block) for i, m in enumerate(group.members)]
        table = self.ctx.backend.ptr_table(ptrs)
        self._tables.append(table)
        return table.ptr

    def _collective(self, op: ResolvedCollective) -> Step:
        send, recv, count, dtype = self._ptr(op.send), self._ptr(op.recv), op.count, op.dtype
        if op.across == "nodes":
            # only the blocks of members on other nodes move; on one node nothing runs (and nothing joins)
            env = self.wiring.env
            per_node = env.local_world_size or env.world_size
            members = [i for i, m in enumerate(self.wiring.group(op.group).members)
                       if m // per_node != env.rank // per_node]
            if not members:
                return lambda: None
            among = self.wiring.collectives_of(op.group, self.ctx.exchange)
            return lambda: among.alltoall_among(send, recv, count, dtype, members)
        coll = self.wiring.collectives_of(op.group, self.ctx.exchange)
        if op.peer is not None:
            g = self.wiring.group(op.group)
            peer = (g.index + op.peer) % g.size  # counted from this member: 1 in a group of 2 is the other one
            return lambda: coll.sendrecv(send, recv, count, dtype, peer)
        fn = getattr(coll, op.collective)
        return lambda: fn(send, recv, count, dtype)

    def close(self) -> None:
        for plan in self._plans.values():
            plan.close()
        self._plans.clear()
        while self._tables:
            self._tables.pop().close()
