"""Manifest -> ResolvedManifest for one world size: vars, groups, sizes and every op's arguments."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NoReturn

from tray.errors import ManifestError, UsageError
from tray.manifest.builtin import BUILTIN_PATH
from tray.manifest.expr import (
    INT_LIMIT,
    PEERS_PREFIX,
    ExprError,
    describe,
    did_you_mean,
    eval_expr,
    expr_names,
    known_list,
    split_ref,
)
from tray.manifest.schema import (
    DTYPE_ITEMSIZE,
    INDEX_PREFIX,
    LOCAL_WORLD_SIZE_VAR,
    NODE_RANKS,
    RANK_ARG,
    RESERVED_VARS,
    WORLD_SIZE_VAR,
    BarrierSpec,
    BufferRef,
    CollectiveSpec,
    CopySpec,
    GemmSpec,
    GroupSpec,
    IntOrExpr,
    LaunchSpec,
    Manifest,
    OpSpec,
    ResolvedArg,
    ResolvedBarrier,
    ResolvedBuffer,
    ResolvedCollective,
    ResolvedCopy,
    ResolvedGemm,
    ResolvedLaunch,
    ResolvedManifest,
    ResolvedOp,
    ResolvedProgram,
    ResolvedStage,
    ResolvedState,
    StageSpec,
)
from tray.text import int_index

Instances = tuple[tuple[int, ...], ...]


def resolve_manifest(
    manifest: Manifest, world_size: int, overrides: dict[str, int] | None = None, local_world_size: int | None = None,
    programs: Iterable[str] | None = None,
) -> ResolvedManifest:
    """See Manifest.resolve."""
    env = resolve_vars(manifest, world_size, overrides, local_world_size)
    return _Resolver(manifest, env, None if programs is None else frozenset(programs)).run()


MAX_WORLD_SIZE = 1 << 20  # ranks of one job (a tray's -n is capped alike: tray.launch.pick.MAX_NPROCS)


def resolve_vars(
    manifest: Manifest, world_size: int, overrides: dict[str, int] | None, local_world_size: int | None = None
) -> dict[str, int]:
    """Defaults, then overrides, then world_size and local_world_size (ranks per node; None or 0: one node,
    world_size). Raises UsageError for bad values or unknown names."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size > MAX_WORLD_SIZE:  # each rank a process: a group of "all" is a tuple of every rank, and so on
        raise UsageError(f"a world of {world_size} ranks: at most {MAX_WORLD_SIZE} (the ranks of the whole job, its "
                         "nodes x ranks per node)")
    local = local_world_size or world_size
    if isinstance(local, bool) or not isinstance(local, int) or local < 1 or world_size % local:
        raise UsageError(
            f"local_world_size (ranks per node) must be an int >= 1 that divides world_size {world_size}, "
            f"got {local_world_size!r}"
        )
    env = dict(manifest.vars)
    for name, value in (overrides or {}).items():
        if name in RESERVED_VARS:
            raise UsageError(
                f"'{name}' cannot be overridden: the tray sets it ({WORLD_SIZE_VAR}: the number of ranks, "
                f"{LOCAL_WORLD_SIZE_VAR}: the ranks per node)"
            )
        if name not in manifest.vars and manifest.path == BUILTIN_PATH and not manifest.vars:
            # the usual cause: --var given, the manifest that declares it not (the ranks took the built-in)
            raise UsageError(
                f"unknown var '{name}': the ranks' manifest is the built-in default (no --manifest given, no "
                "tray.init(manifest=...)), which declares no vars; tray launch --manifest FILE.json gives the ranks "
                "the manifest that declares it"
            )
        if name not in manifest.vars:
            raise UsageError(
                f"unknown var '{name}' for manifest {manifest.name} ({manifest.path}); "
                f"known: {known_list(manifest.vars)}{did_you_mean(name, manifest.vars)}"
            )
        if not isinstance(value, (bool, int)) and hasattr(type(value), "__index__"):
            try:  # a numpy integer (np.int64 from arithmetic on arrays): the int it holds; not numpy's bool
                value = int_index(value)
            except TypeError:
                pass
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= INT_LIMIT:
            raise UsageError(f"var '{name}' must be an int (|value| < 2**63), got {value!r}")
        env[name] = value
    env[WORLD_SIZE_VAR] = world_size
    env[LOCAL_WORLD_SIZE_VAR] = local
    return env


class _Resolver:
    def __init__(self, manifest: Manifest, env: dict[str, int], programs: frozenset[str] | None = None) -> None:
        self.m = manifest
        self.env = env
        self.only = programs  # the programs to resolve; None: all
        self.world_size = env[WORLD_SIZE_VAR]
        self.groups: dict[str, Instances] = {}
        self.buffers: dict[str, ResolvedBuffer] = {}

    def fail(self, json_path: str, message: str) -> NoReturn:
        raise ManifestError(self.m.path, json_path, message)

    def _vars_hint(self, value: IntOrExpr) -> str:
        """What to change when `value` came out too small: the vars given by --var, or the manifest's defaults
        (said not to fit the world size only when the expression depends on it)."""
        names = set() if isinstance(value, int) else expr_names(value)
        mine = sorted(n for n in names if n in self.m.vars)
        given = [n for n in mine if self.env[n] != self.m.vars[n]]
        defaults = [n for n in mine if n not in given]
        parts = [f"{', '.join(given)} given by --var"] if given else []
        if defaults:
            fit = (f" do not fit world_size {self.world_size}" if names & {WORLD_SIZE_VAR, LOCAL_WORLD_SIZE_VAR}
                   else " make it too small")
            parts.append(f"the manifest's defaults of {', '.join(defaults)}{fit}: set them with --var NAME=INT "
                         "(tray launch, tray inspect)")
        return "".join(f"; {p}" for p in parts)

    def int_(self, value: IntOrExpr, jp: str, minimum: int | None = None) -> int:
        try:
            result = eval_expr(value, self.env)
        except ExprError as exc:
            self.fail(jp, str(exc))
        if minimum is not None and result < minimum:
            source = "" if isinstance(value, int) else f" from {describe(value, self.env)}"
            self.fail(jp, f"must be >= {minimum}, got {result}{source}{self._vars_hint(value)}")
        return result

    def run(self) -> ResolvedManifest:
        for group in self.m.groups:
            self.groups[group.name] = self.group(group)
        for i, spec in enumerate(self.m.buffers):
            jp = f"$.buffers[{i}]"
            shape = tuple(self.int_(d, f"{jp}.shape[{k}]", 1) for k, d in enumerate(spec.shape))
            nbytes = self.product([*shape, DTYPE_ITEMSIZE[spec.dtype]], f"{jp}.shape")
            self.buffers[spec.name] = ResolvedBuffer(
                spec.name, spec.dtype, shape, nbytes, spec.export, spec.group, spec.bind
            )
        states = []
        for i, st in enumerate(self.m.states):
            jp = f"$.states[{i}]"
            page_nbytes = self.int_(st.page_nbytes, f"{jp}.page_nbytes", 1)
            pages = self.int_(st.pages, f"{jp}.pages", 1)
            self.product([page_nbytes, pages], jp)
            host_pages = pages if st.host_pages is None else self.int_(st.host_pages, f"{jp}.host_pages", 0)
            self.product([page_nbytes, host_pages], jp)
            states.append(ResolvedState(st.name, page_nbytes, pages, host_pages))
        programs = {}
        for p in self.m.programs:
            if self.only is None or p.name in self.only:
                programs[p.name] = ResolvedProgram(p.name, p.graph, tuple(self.op(op) for op in p.ops))
        return ResolvedManifest(
            manifest=self.m,
            world_size=self.world_size,
            vars=dict(self.env),
            groups=dict(self.groups),
            buffers=tuple(self.buffers.values()),
            states=tuple(states),
            programs=programs,
        )

    def product(self, factors: list[int], jp: str) -> int:
        total = math.prod(factors)
        if total >= INT_LIMIT:
            self.fail(jp, f"size {' x '.join(map(str, factors))} = {total} bytes is out of range (>= 2**63)")
        return total

    def group(self, spec: GroupSpec) -> Instances:
        n = self.world_size
        jp = spec.json_path
        if spec.ranks == "all":
            return (tuple(range(n)),)
        if spec.ranks == NODE_RANKS:
            # one instance per node: global rank = node rank x L + local rank (resolve_vars checked L | n)
            per = self.env[LOCAL_WORLD_SIZE_VAR]
            return tuple(tuple(range(start, start + per)) for start in range(0, n, per))
        if spec.ranks is not None:
            for j, inst in enumerate(spec.ranks):
                for k, rank in enumerate(inst):
                    if rank >= n:
                        self.fail(
                            f"{jp}.ranks[{j}][{k}]",
                            f"rank {rank} of group '{spec.name}' is out of range for world_size {n}"
                            f" (ranks are 0..{n - 1})",
                        )
            return spec.ranks
        assert spec.size is not None  # load guarantees exactly one of ranks and size
        size = self.int_(spec.size, f"{jp}.size", 1)
        if n % size:
            self.fail(
                f"{jp}.size",
                f"world_size {n} is not divisible by group '{spec.name}' size {describe(spec.size, self.env)}"
                f"{'' if isinstance(spec.size, int) else f' = {size}'}; run with a multiple of {size} ranks",
            )
        return tuple(tuple(range(start, start + size)) for start in range(0, n, size))

    # -- ops -----------------------------------------------------------------------------------

    def op(self, spec: OpSpec) -> ResolvedOp:
        jp = spec.json_path
        match spec:
            case LaunchSpec():
                dims = tuple(
                    self.int_(d, spec.dim_paths[k], 1) for k, d in enumerate((*spec.grid, *spec.block))
                )
                return ResolvedLaunch(
                    spec.kernel,
                    (dims[0], dims[1], dims[2]),
                    (dims[3], dims[4], dims[5]),
                    self.int_(spec.shmem, f"{jp}.shmem", 0),
                    tuple(self.arg(a, f"{jp}.args[{k}]") for k, a in enumerate(spec.args)),
                    jp,
                    tuple(self.stage(s) for s in spec.stage),
                )
            case CollectiveSpec():
                return self.collective(spec)
            case GemmSpec():
                m, n, k = (self.int_(v, f"{jp}.{key}", 1) for key, v in (("m", spec.m), ("n", spec.n), ("k", spec.k)))
                item = DTYPE_ITEMSIZE[spec.dtype]
                a, b, c = (
                    self.room(text, f"{jp}.{key}", rows * cols * item, f"gemm {key} ({rows} x {cols} {spec.dtype})")
                    for key, text, rows, cols in (("a", spec.a, m, k), ("b", spec.b, k, n), ("c", spec.c, m, n))
                )
                for ref, key in ((a, "a"), (b, "b"), (c, "c")):
                    held = self.buffers[ref.name].dtype
                    if held != spec.dtype:
                        self.fail(f"{jp}.dtype", f"gemm of {spec.dtype}: its {key} buffer '{ref.name}' holds {held}; "
                                                 "the op's dtype must be its buffers' (the gemm would read and write "
                                                 f"their bytes as {spec.dtype})")
                return ResolvedGemm(a, b, c, m, n, k, spec.dtype, spec.accumulate, jp)
            case BarrierSpec():
                return ResolvedBarrier(spec.group, jp)
            case CopySpec():
                nbytes = self.int_(spec.nbytes, f"{jp}.bytes", 0)
                what = f"copy of {nbytes} B"
                src = self.room(spec.src, f"{jp}.src", nbytes, what)
                return ResolvedCopy(src, self.room(spec.dst, f"{jp}.dst", nbytes, what), nbytes, jp)

    def collective(self, spec: CollectiveSpec) -> ResolvedCollective:
        """count is per rank (NCCL's convention): allgather/reducescatter/alltoall move count x G."""
        jp = spec.json_path
        group_size = max(len(inst) for inst in self.groups[spec.group])
        count = self.int_(spec.count, f"{jp}.count", 0)
        coll = spec.collective
        peer = None
        if spec.peer is not None:
            peer = self.int_(spec.peer, f"{jp}.peer", 0)
            if peer >= group_size:
                self.fail(f"{jp}.peer", f"peer {peer} is outside group '{spec.group}' of {group_size} ranks")
            # member i exchanges with member i + peer, which must exchange with i: 2 * peer = 0 (mod the size)
            unpaired = sorted({len(inst) for inst in self.groups[spec.group]
                               if (2 * peer) % len(inst) or (peer and peer % len(inst) == 0)})
            if unpaired:
                self.fail(f"{jp}.peer", f"peer {peer} pairs member i of group '{spec.group}' with member i + "
                                        f"{peer} (mod the instance's size), which in instances of {unpaired[0]} ranks "
                                        "is not a partner naming it back (or is itself): a sendrecv needs both "
                                        "members of a pair to name each other; give 0 (itself) or half the size of "
                                        "every instance")
        item = DTYPE_ITEMSIZE[spec.dtype]
        send_elems = count * group_size if coll in ("reducescatter", "alltoall") else count
        recv_elems = count * group_size if coll in ("allgather", "alltoall") else count
        what = f"{coll} of count {count} {spec.dtype} over group '{spec.group}' ({group_size} ranks)"
        send = self.room(spec.send, f"{jp}.send", send_elems * item, what)
        recv = self.room(spec.recv, f"{jp}.recv", recv_elems * item, what)
        for ref, key in ((send, "send"), (recv, "recv")):
            held = self.buffers[ref.name].dtype
            if held != spec.dtype:
                self.fail(f"{jp}.dtype", f"{what}: its {key} buffer '{ref.name}' holds {held}; the op's dtype must be "
                                         f"its buffers' (the collective would read their bytes as {spec.dtype})")
        return ResolvedCollective(coll, spec.group, send, recv, count, spec.dtype, peer, jp, spec.across)

    def stage(self, spec: StageSpec) -> ResolvedStage:
        """A staging buffer holds one block per member of the peer table's group (the largest instance)."""
        block = self.int_(spec.block, f"{spec.json_path}.block", 1)
        group = self.buffers[spec.peers].group
        size = max(len(inst) for inst in self.groups[group])
        what = f"staging of peers:{spec.peers} ({size} members x {block} B)"
        return ResolvedStage(spec.peers, self.room(spec.buffer, f"{spec.json_path}.buffer", size * block, what), block)

    def ref(self, text: str, jp: str) -> BufferRef:
        name, offset_expr = split_ref(text)
        buf = self.buffers[name]
        offset = 0 if offset_expr is None else self.int_(offset_expr, jp, 0)
        if offset > buf.nbytes:
            self.fail(jp, f"offset {offset} B is past the end of buffer '{name}' ({buf.nbytes} B)")
        return BufferRef(name, offset)

    def room(self, text: str, jp: str, nbytes: int, what: str) -> BufferRef:
        """The reference, after checking `nbytes` fit between its offset and its buffer's end."""
        ref = self.ref(text, jp)
        size = self.buffers[ref.name].nbytes
        if ref.offset + nbytes > size:
            self.fail(
                jp,
                f"{what} needs {nbytes} B from offset {ref.offset} of buffer '{ref.name}', which holds"
                f" {size} B; enlarge the buffer or shrink the op",
            )
        return ref

    def arg(self, raw: str | float, jp: str) -> ResolvedArg:
        if isinstance(raw, int):
            return ResolvedArg("int", value=raw)
        if isinstance(raw, float):
            return ResolvedArg("float", value=raw)
        if raw.startswith(PEERS_PREFIX):
            return ResolvedArg("peers", name=raw[len(PEERS_PREFIX) :])
        if raw == RANK_ARG:
            return ResolvedArg("rank")
        if raw.startswith(INDEX_PREFIX):
            return ResolvedArg("index", name=raw[len(INDEX_PREFIX) :])
        if raw in self.env:
            return ResolvedArg("int", name=raw, value=self.env[raw])
        ref = self.ref(raw, jp)
        return ResolvedArg("buffer", name=ref.name, offset=ref.offset)
