"""Control messages between the heads of a job and its root (README.md, "Several nodes"): typed frozen
dataclasses <-> checked msgpack bytes, in the envelope of wire.py ({kind, v, token, ...}).

Each message declares its fields once, in FIELDS (name -> check); encoding, decoding and the
refusal of unknown or missing fields all follow from that table. Node ranks name the sender; the
root answers per step with one message per node, so the root handles O(nodes) messages per step.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self, TypeAlias

from tray.errors import WireError
from tray.handshake import wire
from tray.handshake.wire import (
    _SCALARS,
    PROTOCOL_VERSION,
    _as_float,
    _as_float_map,
    _as_int,
    _as_list,
    _as_plains,
    _as_str,
    _fields,
)
from tray.manifest.digest import parts_differing

# (value, field path) -> checked value
Check: TypeAlias = Callable[..., Any]


def _int(lo: int | None = None) -> Check:
    return lambda v, p: _as_int(v, p, lo=lo)


def _str(*choices: str) -> Check:
    return lambda v, p: _as_str(v, p, choices)


def _exit_code(v: Any, p: str) -> int:
    """A failure's exit code, which every head exits with: 1..255 (the status a process can have; 256 is 0)."""
    code = _as_int(v, p, lo=1)
    if code > 255:
        raise WireError(f"field '{p}': expected an exit code of at most 255, got {code}")
    return code


def _float(v: Any, p: str) -> float:
    return _as_float(v, p)


# NOTE: the lists below (a step's ranks, values and waits: one entry per rank of the job in a decision) are checked
# whole first, and element by element, naming the bad one, only when that fails: a path string per element was most of
# the root's and the heads' cost of a decision


def _ints(v: Any, p: str) -> tuple[int, ...]:
    items = _as_list(v, p)
    if all(type(x) is int and x >= 0 for x in items):
        return tuple(items)
    return tuple(_as_int(x, f"{p}[{i}]", lo=0) for i, x in enumerate(items))


def _floats(v: Any, p: str) -> tuple[float, ...]:
    items = _as_list(v, p)
    if all(type(x) is float and math.isfinite(x) for x in items):
        return tuple(items)
    return tuple(_as_float(x, f"{p}[{i}]") for i, x in enumerate(items))


def _strs(v: Any, p: str) -> tuple[str, ...]:
    items = _as_list(v, p)
    if all(type(x) is str for x in items):
        return tuple(items)
    return tuple(_as_str(x, f"{p}[{i}]") for i, x in enumerate(items))


def _int_lists(v: Any, p: str) -> tuple[tuple[int, ...], ...]:
    return tuple(_ints(x, f"{p}[{i}]") for i, x in enumerate(_as_list(v, p)))


def _plains(v: Any, p: str) -> tuple[Any, ...]:
    return tuple(_as_plains(_as_list(v, p), p))


def _to_wire(value: Any) -> Any:
    if isinstance(value, tuple):
        return [v if type(v) in _SCALARS else _to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: value[k] for k in sorted(value)}
    return value


@dataclass(frozen=True, slots=True)
class _JobMessage(wire._Message):
    """A head <-> root message: its fields and their checks in FIELDS; encoded as every wire message."""

    FIELDS: ClassVar[dict[str, Check]]
    # list fields of one entry per rank (or step) each: of one length
    PARALLEL: ClassVar[tuple[str, ...]] = ()

    def to_body(self) -> dict[str, Any]:
        body = {"kind": self.KIND, "v": PROTOCOL_VERSION, "token": self.token}
        for name, check in self.FIELDS.items():  # joins: a list of pairs (msgpack map keys are strings here)
            value = getattr(self, name)
            body[name] = wire.joins_to_wire(value) if check is wire.joins_from_wire else _to_wire(value)
        return body

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        names = cls.__dict__.get("_NAMES")
        if names is None:  # the wire's field names, once per class
            names = ("token", *cls.FIELDS)
            type.__setattr__(cls, "_NAMES", names)
        b = _fields(body, names, prefix)
        token = _as_str(b["token"], prefix + "token")
        values = {}
        for name, check in cls.FIELDS.items():
            values[name] = check(b[name], prefix + name)
        if len({len(values[name]) for name in cls.PARALLEL}) > 1:
            said = ", ".join(f"'{prefix}{name}' {len(values[name])}" for name in cls.PARALLEL)
            raise WireError(f"fields of one entry each per rank or step differ in length: {said}")
        return cls(token=token, **values)


@dataclass(frozen=True, slots=True)
class NodeJoin(_JobMessage):
    """head -> root, first: which node this is and what it runs (checked against every other node)."""

    KIND: ClassVar[str] = "node_join"
    FIELDS: ClassVar[dict[str, Check]] = {
        "node_rank": _int(0), "nnodes": _int(1), "local_world_size": _int(1), "rdzv_id": _str(),
        "hostname": _str(), "pid": _int(1), "manifest": _str(), "backend": _str(*wire.BACKENDS),
        "manifest_parts": _strs}
    node_rank: int
    nnodes: int
    local_world_size: int
    rdzv_id: str
    hostname: str
    pid: int
    manifest: str
    backend: str
    # the manifest's parts by digest (tray.manifest.digest.part_digests): where two nodes' manifests differ
    manifest_parts: tuple[str, ...] = ()


def manifest_with_vars(digest: str, variables: Mapping[str, int]) -> str:
    """NodeJoin's `manifest`: the manifest's digest, then the --var values a node was launched with (the digest does
    not cover them), `<digest>+name=value,...` in name order."""
    return digest + ("+" + ",".join(f"{k}={variables[k]}" for k in sorted(variables)) if variables else "")


def manifest_differs(theirs: str, ours: str, theirs_parts: tuple[str, ...] = (),
                     ours_parts: tuple[str, ...] = ()) -> str:
    """How a node's NodeJoin `manifest` differs from node 0's (both from manifest_with_vars), for a message; with
    both nodes' `manifest_parts`, in which parts."""
    (d1, _, v1), (d0, _, v0) = theirs.partition("+"), ours.partition("+")
    if d1 != d0:
        where = parts_differing(theirs_parts, ours_parts) if theirs_parts and ours_parts else []
        return (f"manifest {d1[:12]}..., node 0 loaded {d0[:12]}..." + (f" (they differ in {', '.join(where)})"
                                                                       if where else "") +
                "; run every node with the same manifest file and kernels")
    return f"--var {v1 or '(none)'}, node 0 has --var {v0 or '(none)'}; launch every node with the same --var values"


@dataclass(frozen=True, slots=True)
class NodeOffers(_JobMessage):
    """head -> root: every rank of the node offered and the head checked the offers; `joins` the join info they
    carry (rank -> {group: info}, non-empty only: wire.joins_of), the one part of them other nodes' ranks use."""

    KIND: ClassVar[str] = "node_offers"
    FIELDS: ClassVar[dict[str, Check]] = {"node_rank": _int(0), "joins": wire.joins_from_wire}
    node_rank: int
    joins: dict[int, dict[str, bytes]]


@dataclass(frozen=True, slots=True)
class JobTable(_JobMessage):
    """root -> each head: every node offered; `joins` the join info of the ranks that lead (are member 0 of) an instance
    of a group with a member on that node (rank -> {group: info}). Each head hands its ranks a table of their own
    offers and these (wire.Table): what a node's ranks use of other nodes' offers. It grows with the instances of the
    groups that span nodes a node's ranks are in, not with the job's offers."""

    KIND: ClassVar[str] = "job_table"
    FIELDS: ClassVar[dict[str, Check]] = {"joins": wire.joins_from_wire}
    joins: dict[int, dict[str, bytes]]


@dataclass(frozen=True, slots=True)
class NodeReady(_JobMessage):
    """head -> root: every rank of the node is ready; `timings` {phase: slowest seconds}."""

    KIND: ClassVar[str] = "node_ready"
    FIELDS: ClassVar[dict[str, Check]] = {"node_rank": _int(0), "timings": _as_float_map}
    node_rank: int
    timings: dict[str, float]


@dataclass(frozen=True, slots=True)
class JobGo(_JobMessage):
    """root -> every head: every node is ready; `t_go` is the root's time.time()."""

    KIND: ClassVar[str] = "job_go"
    FIELDS: ClassVar[dict[str, Check]] = {"t_go": _float}
    t_go: float


@dataclass(frozen=True, slots=True)
class NodeVote(_JobMessage):
    """head -> root: the votes of this node's ranks for (`topic`, `round`); `values[i]` from `ranks[i]`, who waits
    `waits[i]` more seconds for the decision (then it may give the step up and go on)."""

    KIND: ClassVar[str] = "node_vote"
    FIELDS: ClassVar[dict[str, Check]] = {"node_rank": _int(0), "topic": _str(), "round": _int(0),
                                          "ranks": _ints, "values": _plains, "waits": _floats}
    PARALLEL: ClassVar[tuple[str, ...]] = ("ranks", "values", "waits")
    node_rank: int
    topic: str
    round: int
    ranks: tuple[int, ...]
    values: tuple[Any, ...]
    waits: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class NodeHeld(_JobMessage):
    """head -> root: the votes this head holds in tray-wide steps, their node's other ranks not having voted yet:
    rank `ranks[i]` waits in (`topics[i]`, `rounds[i]`) `waits[i]` more seconds. It replaces the node's last one; a
    NodeVote of a step supersedes its entries. Sent only when such votes stay held a while (ranks of a node in
    lockstep never send one): the root needs them to see steps that wait for one another across nodes."""

    KIND: ClassVar[str] = "node_held"
    FIELDS: ClassVar[dict[str, Check]] = {"node_rank": _int(0), "topics": _strs, "rounds": _ints, "ranks": _ints,
                                          "waits": _floats}
    PARALLEL: ClassVar[tuple[str, ...]] = ("topics", "rounds", "ranks", "waits")
    node_rank: int
    topics: tuple[str, ...]
    rounds: tuple[int, ...]
    ranks: tuple[int, ...]
    waits: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class JobDecision(_JobMessage):
    """root -> heads with voters: the values of (`topic`, `round`) in voter order (`ranks`); when the
    step timed out, `missing` names the ranks that never voted (their values are None) and `waited_s`
    how long the first voter waited."""

    KIND: ClassVar[str] = "job_decision"
    FIELDS: ClassVar[dict[str, Check]] = {"topic": _str(), "round": _int(0), "ranks": _ints, "values": _plains,
                                          "missing": _ints, "waited_s": _float}
    PARALLEL: ClassVar[tuple[str, ...]] = ("ranks", "values")
    topic: str
    round: int
    ranks: tuple[int, ...]
    values: tuple[Any, ...]
    missing: tuple[int, ...]
    waited_s: float


_FAILURE_FIELDS: dict[str, Check] = {"node_rank": _int(-1), "rank": _int(-1), "summary": _str(),
                                     "report": _str(), "tail": _strs, "exit_code": _exit_code}


# a failure's text, cut to fit one control message (MAX_MESSAGE_NBYTES) with room to spare: a rank's last lines
# may each be 64 KiB, and its report a long traceback
_SUMMARY_NBYTES = 16 << 10
_REPORT_NBYTES = 256 << 10
_TAIL_NBYTES = 256 << 10


def _cut(text: str, nbytes: int, keep_end: bool = False) -> str:
    """`text` if its UTF-8 is at most `nbytes`, else its start (or end) within that many bytes, marked '...'."""
    raw = text.encode("utf-8", "surrogateescape")
    if len(raw) <= nbytes:
        return text
    if keep_end:
        return "..." + raw[-(nbytes - 3):].decode("utf-8", "ignore")
    return raw[:nbytes - 3].decode("utf-8", "ignore") + "..."


@dataclass(frozen=True, slots=True)
class _FailureMessage(_JobMessage):
    """A failure: on which node and rank (-1: the node as a whole), why, its report and last lines."""

    FIELDS: ClassVar[dict[str, Check]] = _FAILURE_FIELDS
    node_rank: int
    rank: int
    summary: str
    report: str
    tail: tuple[str, ...]
    exit_code: int

    @classmethod
    def bounded(cls, *, token: str, node_rank: int, rank: int, summary: str, report: str, tail: tuple[str, ...],
                exit_code: int) -> Self:
        """The message with its texts cut to fit: the summary's start, the report's end (a traceback's cause),
        each of the last lines' start within an equal share of the tail's budget."""
        share = _TAIL_NBYTES // max(1, len(tail))
        return cls(token=token, node_rank=node_rank, rank=rank, summary=_cut(summary, _SUMMARY_NBYTES),
                   report=_cut(report, _REPORT_NBYTES, keep_end=True), tail=tuple(_cut(line, share) for line in tail),
                   exit_code=exit_code)


@dataclass(frozen=True, slots=True)
class NodeFailure(_FailureMessage):
    """head -> root: the first failure on this node (`rank` -1: the node as a whole)."""

    KIND: ClassVar[str] = "node_failure"


@dataclass(frozen=True, slots=True)
class JobStop(_FailureMessage):
    """root -> every head: the job's root cause (the first failure anywhere); stop every rank. The steps still
    undecided then, for every head to print: (`pending_topics[i]`, `pending_rounds[i]`) had not heard from ranks
    `pending_missing[i]` (votes held at a head a moment are not known to the root: each head corrects its own)."""

    KIND: ClassVar[str] = "job_stop"
    FIELDS: ClassVar[dict[str, Check]] = {**_FAILURE_FIELDS, "pending_topics": _strs, "pending_rounds": _ints,
                                          "pending_missing": _int_lists}
    PARALLEL: ClassVar[tuple[str, ...]] = ("pending_topics", "pending_rounds", "pending_missing")
    pending_topics: tuple[str, ...] = ()
    pending_rounds: tuple[int, ...] = ()
    pending_missing: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class NodeDone(_JobMessage):
    """head -> root: every rank of this node exited 0."""

    KIND: ClassVar[str] = "node_done"
    FIELDS: ClassVar[dict[str, Check]] = {"node_rank": _int(0)}
    node_rank: int


@dataclass(frozen=True, slots=True)
class NodeLeft(_JobMessage):
    """head -> root: rank `rank` of this node takes part in no step any more (after go): it exited 0 or closed its
    tray; `how` says which. The root fails a job-wide step other ranks wait in that it never voted in."""

    KIND: ClassVar[str] = "node_left"
    FIELDS: ClassVar[dict[str, Check]] = {"node_rank": _int(0), "rank": _int(0), "how": _str()}
    node_rank: int
    rank: int
    how: str


@dataclass(frozen=True, slots=True)
class JobEnd(_JobMessage):
    """root -> every head: every node is done; the job succeeded."""

    KIND: ClassVar[str] = "job_end"
    FIELDS: ClassVar[dict[str, Check]] = {"nnodes": _int(1)}
    nnodes: int


@dataclass(frozen=True, slots=True)
class Beat(_JobMessage):
    """Both ways, every HEARTBEAT_INTERVAL_S: the sender (node `node_rank`; the root says 0) is alive."""

    KIND: ClassVar[str] = "beat"
    FIELDS: ClassVar[dict[str, Check]] = {"node_rank": _int(0), "seq": _int(0)}
    node_rank: int
    seq: int


JobMessage: TypeAlias = (NodeJoin | NodeOffers | JobTable | NodeReady | JobGo | NodeVote | NodeHeld | JobDecision
                         | NodeFailure | JobStop | NodeDone | NodeLeft | JobEnd | Beat)
KINDS: dict[str, type[JobMessage]] = {cls.KIND: cls for cls in (
    NodeJoin, NodeOffers, JobTable, NodeReady, JobGo, NodeVote, NodeHeld, JobDecision, NodeFailure, JobStop,
    NodeDone, NodeLeft, JobEnd, Beat)}


# NOTE: the root sends a message of this size or more deflated (zlib, level 1), as two frames [DEFLATED, deflated]:
# a decision over many ranks (every rank's value), which CURVE encrypts once per node on one I/O thread. Before
# protocol 8 the table held every offer: 2.56 MB for every node of a job of 1,000 nodes of 4, 0.61 MB deflated.
# Smaller ones, and all a head sends, are one frame.
DEFLATE_FROM = 16 * 1024
DEFLATED = b"z"


def frames_of(data: bytes) -> list[bytes]:
    """The frames that carry the encoded message `data` from the root to a head: deflated when that makes it smaller
    (a decision of random bytes does not shrink)."""
    if len(data) < DEFLATE_FROM:
        return [data]
    deflated = zlib.compress(data, 1)
    return [DEFLATED, deflated] if len(deflated) < len(data) else [data]


def message_of(frames: list[bytes], limit: int) -> bytes:
    """The encoded message that `frames` (as frames_of made them) carry, at most `limit` bytes once inflated;
    WireError for other frames, or a deflated message that does not inflate whole within the limit."""
    if len(frames) == 1:
        return frames[0]
    if len(frames) != 2:
        raise WireError(f"expected 1 frame, or 2 ({DEFLATED!r} and a deflated message), got {len(frames)}")
    if frames[0] != DEFLATED:
        raise WireError(f"expected {DEFLATED!r} as the first of 2 frames, got {bytes(frames[0][:16])!r}")
    inflate = zlib.decompressobj()
    try:
        data = inflate.decompress(frames[1], limit + 1)
    except zlib.error as exc:
        raise WireError(f"a deflated message that does not inflate ({exc})") from None
    if len(data) > limit or inflate.unconsumed_tail:
        raise WireError(f"a deflated message that inflates past the limit of {limit} bytes")
    if not inflate.eof or inflate.unused_data:
        raise WireError("a deflated message that does not end where its frame does")
    return data


def decode(data: bytes, *, token: str, sender: str | None = None, limit: int = wire.MAX_MESSAGE_NBYTES) -> JobMessage:
    """Check and decode one job message of at most `limit` bytes (a head reading the root: wire.job_message_limit);
    raises WireError (only) saying what was expected and seen."""
    return wire.decode_kinds(KINDS, data, token=token, sender=sender, limit=limit)  # type: ignore[no-any-return]
