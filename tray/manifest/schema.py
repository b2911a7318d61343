"""The manifest as frozen data: specs as written (`Manifest`) and as resolved for one world size."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Literal, TypeVar

from tray.errors import ManifestError, UsageError
from tray.manifest.expr import ExprError, did_you_mean, eval_expr, known_list

FORMAT_VERSION = 1

# NOTE: kept here (not imported from tray.backend.base) so this package stays free of numpy;
# tests/unit/test_manifest.py checks the two tables agree.
DTYPE_ITEMSIZE: dict[str, int] = {
    "u8": 1, "i8": 1, "u16": 2, "i16": 2, "u32": 4, "i32": 4, "u64": 8, "i64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
}  # fmt: skip

OP_TYPES = ("launch", "nccl", "gemm", "barrier", "copy")
COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall", "sendrecv")
# `nccl` ops' "across": which blocks of an alltoall move ("nodes": only those between nodes)
ACROSS = ("nodes",)
WORLD = "world"
WORLD_SIZE_VAR = "world_size"
LOCAL_WORLD_SIZE_VAR = "local_world_size"  # ranks per node of the job (world_size on one node)
RESERVED_VARS = (WORLD_SIZE_VAR, LOCAL_WORLD_SIZE_VAR)
NODE_RANKS: Final = "node"  # a group's "ranks": "node": one instance per node of the job, its ranks in order
# Launch arguments that differ per rank (everything else is the same on every rank):
RANK_ARG = "rank"  # this rank's global rank
INDEX_PREFIX = "index:"  # "index:<group>": this rank's member index in its instance of <group>

IntOrExpr = int | str
Ranks = Literal["all", "node"] | tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class GroupSpec:
    """A topology group: exactly one of `ranks` ("all", "node" or explicit instances) and `size` is set.

    `size` splits the world into contiguous blocks of that many ranks; world_size must divide by it.
    "node" splits it into the ranks of each node of the job (blocks of local_world_size, known at launch).
    """

    name: str
    ranks: Ranks | None
    size: IntOrExpr | None
    json_path: str = "$.groups"  # where it was declared; the implicit world group has none of its own


@dataclass(frozen=True)
class BufferSpec:
    """A device buffer: `shape` in elements of `dtype` (empty = scalar); peer tables span `group`."""

    name: str
    dtype: str
    shape: tuple[IntOrExpr, ...]
    export: bool
    group: str
    bind: dict[str, Any] | None = field(default=None, hash=False)


@dataclass(frozen=True)
class StateSpec:
    """Paged state (e.g. a KV cache): `pages` pages of `page_nbytes` bytes each on the device, and a
    host tier of `host_pages` pages (park/wake) in the rank's pinned host pool; None means `pages`."""

    name: str
    page_nbytes: IntOrExpr
    pages: IntOrExpr
    host_pages: IntOrExpr | None = None


@dataclass(frozen=True)
class KernelSpec:
    """A CUDA C kernel: `source` is the file's absolute path, `code` its bytes as read once by the
    loader (the bytes the digest covers are the bytes the backend compiles), `entry` the extern "C"
    function name. `programmatic`: launched with programmatic stream serialization (it may start while
    the kernel before it still runs, so it must `griddepcontrol.wait` before it touches memory that
    kernel wrote; the cuda backend only, sm_90+)."""

    name: str
    source: str
    entry: str
    options: tuple[str, ...]
    peers: bool
    code: bytes = field(default=b"", repr=False, compare=False)
    programmatic: bool = False


# -- ops as written: one frozen type per op kind, each with its JSON path for errors ----------------
# Buffer references are strings `"name"` or `"name@offset_expr"` (offset in bytes).

Dim3 = tuple[IntOrExpr, IntOrExpr, IntOrExpr]
LaunchArg = str | int | float


@dataclass(frozen=True)
class StageSpec:
    """Where a launch's peer table of buffer `peers` points for members on another node (a group that
    spans nodes: no peer mapping between nodes): at `buffer` (a buffer reference on this rank), block by
    block. The kernel writes block `me` of member g's buffer (`block` bytes at me * block); for g on
    another node its table entry is buffer + (g - me) * block, so that write lands in block g of the
    staging buffer, from where a `nccl` alltoall with `"across": "nodes"` carries it to member g."""

    peers: str
    buffer: str
    block: IntOrExpr
    json_path: str


@dataclass(frozen=True)
class LaunchSpec:
    """`launch`: kernel `kernel` on `grid` x `block` (missing trailing dims are 1) with `shmem` bytes of
    dynamic shared memory. `dim_paths` holds the JSON path of each grid then block dimension. `stage`:
    the staging of its peer tables for members on other nodes (StageSpec), by peer-table buffer."""

    op: ClassVar[str] = "launch"  # the JSON name of the op kind

    kernel: str
    grid: Dim3
    block: Dim3
    shmem: IntOrExpr
    args: tuple[LaunchArg, ...]
    json_path: str
    dim_paths: tuple[str, ...] = field(default=(), compare=False)
    stage: tuple[StageSpec, ...] = ()


@dataclass(frozen=True)
class CollectiveSpec:
    """`nccl` (the collectives of a group): `count` elements of `dtype` per rank; `peer` (a member
    index) only for sendrecv. `across` "nodes" (alltoall only): only the blocks between members on
    different nodes move (within a node, peer kernels wrote them already); on one node nothing runs."""

    op: ClassVar[str] = "nccl"  # the JSON name of the op kind

    collective: str
    group: str
    send: str
    recv: str
    count: IntOrExpr
    dtype: str
    peer: IntOrExpr | None
    json_path: str
    across: str = ""


@dataclass(frozen=True)
class GemmSpec:
    """`gemm`: C[m, n] (+)= A[m, k] @ B[n, k]^T in `dtype`."""

    op: ClassVar[str] = "gemm"  # the JSON name of the op kind

    a: str
    b: str
    c: str
    m: IntOrExpr
    n: IntOrExpr
    k: IntOrExpr
    dtype: str
    accumulate: bool
    json_path: str


@dataclass(frozen=True)
class BarrierSpec:
    """`barrier`: the peer barrier of `group`."""

    op: ClassVar[str] = "barrier"  # the JSON name of the op kind

    group: str
    json_path: str


@dataclass(frozen=True)
class CopySpec:
    """`copy`: `nbytes` bytes (the JSON key "bytes") from `src` to `dst`."""

    op: ClassVar[str] = "copy"  # the JSON name of the op kind

    src: str
    dst: str
    nbytes: IntOrExpr
    json_path: str


OpSpec = LaunchSpec | CollectiveSpec | GemmSpec | BarrierSpec | CopySpec


@dataclass(frozen=True)
class ProgramSpec:
    """An ordered list of ops that every rank runs in lockstep; `graph` captures it as one graph."""

    name: str
    graph: bool
    ops: tuple[OpSpec, ...]


@dataclass(frozen=True)
class Manifest:
    """A validated manifest. `doc` is the JSON as loaded; `digest` proves two ranks hold the same one."""

    path: str
    name: str
    description: str
    format: int
    vars: dict[str, int] = field(hash=False)
    groups: tuple[GroupSpec, ...]
    buffers: tuple[BufferSpec, ...]
    states: tuple[StateSpec, ...]
    kernels: tuple[KernelSpec, ...]
    programs: tuple[ProgramSpec, ...]
    digest: str
    doc: dict[str, Any] = field(hash=False, repr=False)
    # the timeout of the programs' barrier ops (and of rank.barrier() without one), s; None: the tray's default
    barrier_timeout_s: float | None = None

    def group(self, name: str) -> GroupSpec:
        """The group named `name`. Raises UsageError naming the known groups."""
        return _lookup("group", name, {g.name: g for g in self.groups})

    def buffer(self, name: str) -> BufferSpec:
        """The buffer named `name`. Raises UsageError naming the known buffers."""
        return _lookup("buffer", name, {b.name: b for b in self.buffers})

    def kernel(self, name: str) -> KernelSpec:
        """The kernel named `name`. Raises UsageError naming the known kernels."""
        return _lookup("kernel", name, {k.name: k for k in self.kernels})

    def program(self, name: str) -> ProgramSpec:
        """The program named `name`. Raises UsageError naming the known programs."""
        return _lookup("program", name, {p.name: p for p in self.programs})

    def resolve(self, world_size: int, overrides: dict[str, int] | None = None,
                local_world_size: int | None = None, programs: Iterable[str] | None = None) -> ResolvedManifest:
        """Evaluate every expression for `world_size` ranks and `overrides` of the var defaults, in a job of
        `local_world_size` ranks per node (None: one node, world_size). `programs`: the programs to resolve (None:
        all); the others are left out of the result, unchecked (vars given to one run() concern its program alone).

        Raises UsageError for a bad world size, local world size (not dividing world_size) or override
        (unknown or reserved var, non-int value), and
        ManifestError (with the JSON path) for expressions that fail, non-positive dims, groups that
        do not fit the world, and ops whose sizes overrun their buffers.
        """
        from tray.manifest.resolve import resolve_manifest  # here: resolve.py imports this module

        return resolve_manifest(self, world_size, overrides, local_world_size, programs)


@dataclass(frozen=True)
class ResolvedBuffer:
    """A buffer at one world size: `shape` in elements, `nbytes` = prod(shape) * itemsize."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    export: bool
    group: str
    bind: dict[str, Any] | None = field(default=None, hash=False)


@dataclass(frozen=True)
class ResolvedState:
    """A paged state at one world size; `nbytes` = pages * page_nbytes on the device, `host_nbytes` =
    host_pages * page_nbytes in the host tier. `host_pages` None (not given) becomes `pages`."""

    name: str
    page_nbytes: int
    pages: int
    host_pages: int = None  # type: ignore[assignment]  # NOTE: None -> pages in __post_init__

    def __post_init__(self) -> None:
        if self.host_pages is None:
            object.__setattr__(self, "host_pages", self.pages)

    @property
    def nbytes(self) -> int:
        return self.page_nbytes * self.pages

    @property
    def host_nbytes(self) -> int:
        return self.page_nbytes * self.host_pages


@dataclass(frozen=True)
class BufferRef:
    """A resolved buffer reference: `offset` bytes into buffer `name`."""

    name: str
    offset: int = 0


@dataclass(frozen=True)
class ResolvedArg:
    """A resolved launch argument.

    kind "buffer": a pointer `offset` bytes into `name`; "peers": the peer pointer table of `name`
    (one pointer per rank of the buffer's group instance); "int" / "float": `value` (`name` is the
    var it came from, or None for a literal); "rank": the running rank; "index": the running rank's
    member index in group `name` (both filled in by the executor).
    """

    kind: Literal["buffer", "peers", "int", "float", "rank", "index"]
    name: str | None = None
    offset: int = 0
    value: int | float = 0


# -- ops as resolved: every expression evaluated, buffer references checked to fit ------------------


@dataclass(frozen=True)
class ResolvedStage:
    """StageSpec resolved: peer table of `peers`, members on other nodes at `buffer` + (g - me) * `block`."""

    peers: str
    buffer: BufferRef
    block: int


@dataclass(frozen=True)
class ResolvedLaunch:
    op: ClassVar[str] = "launch"  # the JSON name of the op kind

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shmem: int
    args: tuple[ResolvedArg, ...]
    json_path: str
    stage: tuple[ResolvedStage, ...] = ()

    def staged(self, peers: str) -> ResolvedStage | None:
        """The staging of peer table `peers`, None when the op stages none."""
        return next((s for s in self.stage if s.peers == peers), None)


@dataclass(frozen=True)
class ResolvedCollective:
    """`count` is per rank (NCCL's convention); `peer` is a member index, None unless sendrecv."""

    op: ClassVar[str] = "nccl"  # the JSON name of the op kind

    collective: str
    group: str
    send: BufferRef
    recv: BufferRef
    count: int
    dtype: str
    peer: int | None
    json_path: str
    across: str = ""


@dataclass(frozen=True)
class ResolvedGemm:
    op: ClassVar[str] = "gemm"  # the JSON name of the op kind

    a: BufferRef
    b: BufferRef
    c: BufferRef
    m: int
    n: int
    k: int
    dtype: str
    accumulate: bool
    json_path: str


@dataclass(frozen=True)
class ResolvedBarrier:
    op: ClassVar[str] = "barrier"  # the JSON name of the op kind

    group: str
    json_path: str


@dataclass(frozen=True)
class ResolvedCopy:
    op: ClassVar[str] = "copy"  # the JSON name of the op kind

    src: BufferRef
    dst: BufferRef
    nbytes: int
    json_path: str


ResolvedOp = ResolvedLaunch | ResolvedCollective | ResolvedGemm | ResolvedBarrier | ResolvedCopy


@dataclass(frozen=True)
class ResolvedProgram:
    name: str
    graph: bool
    ops: tuple[ResolvedOp, ...]


@dataclass(frozen=True)
class ResolvedManifest:
    """A manifest resolved for one world size. `vars` includes `world_size`.

    `groups` maps every group name ("world" included) to its instances, each a tuple of global ranks
    in member order.
    """

    manifest: Manifest
    world_size: int
    vars: dict[str, int] = field(hash=False)
    groups: dict[str, tuple[tuple[int, ...], ...]] = field(hash=False)
    buffers: tuple[ResolvedBuffer, ...]
    states: tuple[ResolvedState, ...]
    programs: dict[str, ResolvedProgram] = field(hash=False)

    def group_of(self, name: str, rank: int) -> tuple[int, ...] | None:
        """The instance of group `name` that contains `rank`, or None. UsageError for unknown groups."""
        instances = _lookup("group", name, self.groups)
        return next((inst for inst in instances if rank in inst), None)

    def buffer(self, name: str) -> ResolvedBuffer:
        """The resolved buffer named `name`. Raises UsageError naming the known buffers."""
        return _lookup("buffer", name, {b.name: b for b in self.buffers})

    def program(self, name: str) -> ResolvedProgram:
        """The resolved program named `name`. Raises UsageError naming the known programs."""
        return _lookup("program", name, self.programs)

    def eval(self, value: IntOrExpr, json_path: str) -> int:
        """Evaluate an int or expression with this manifest's vars; ManifestError at `json_path`."""
        try:
            return eval_expr(value, self.vars)
        except ExprError as exc:
            raise ManifestError(self.manifest.path, json_path, str(exc)) from None


_T = TypeVar("_T")


def _lookup(kind: str, name: str, table: dict[str, _T]) -> _T:
    if name not in table:
        raise UsageError(f"unknown {kind} '{name}'; known: {known_list(table)}{did_you_mean(name, table)}")
    return table[name]
