"""Control messages between head and ranks: typed frozen dataclasses <-> checked msgpack bytes."""

from __future__ import annotations

import hmac
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self, TypeAlias

import msgpack  # type: ignore[import-untyped]

from tray.errors import UsageError, WireError
from tray.text import seconds_value

# 7: the root deflates a large message (jobwire.frames_of), which a head of 6 cannot read; 8: a table holds the offers
# of its node's ranks and the join info of other nodes' (`joins`), where 7 held every offer of the job
PROTOCOL_VERSION = 8
# NOTE: the largest legitimate message of one host is a Table for 8+ ranks, a few KiB (an ErrorReport with a long
# traceback maybe tens of KiB). Anything near a MiB is garbage or an attack; refuse it before unpacking.
MAX_MESSAGE_NBYTES = 1 << 20
MAX_FRAME_NBYTES = MAX_MESSAGE_NBYTES + 4096  # the sockets' MAXMSGSIZE: a message and its frame's envelope
# NOTE: a message with an entry per rank of the job (a decision; a table, which holds join info of other nodes' ranks),
# sent by a head or the root only, may take this much per rank where that is more than MAX_MESSAGE_NBYTES (a job of
# more than 256 ranks): a tray-wide step's decision holds every rank's value
PER_RANK_NBYTES = 4096
LONGEST_WAIT_S = 1e9  # a vote's wait_s: an endless wait (inf) is sent as this


def step_wait(timeout_s: float, what: str) -> float:
    """A step's timeout as it is waited for and sent: > 0 (UsageError otherwise, NaN too), inf as LONGEST_WAIT_S."""
    t = seconds_value(timeout_s)  # NaN for what is no number of seconds (a bool, a string), refused below
    if not t > 0:
        raise UsageError(f"{what}: timeout_s must be a number of seconds > 0 (inf: no end), got "
                         f"{type(timeout_s).__name__} {repr(timeout_s)[:60]}")
    return min(t, LONGEST_WAIT_S)
# NOTE: a CUDA fabric handle (CUmemFabricHandle) is 64 opaque bytes. A group's join info is whatever
# its collectives need (an ncclUniqueId is 128 bytes); 4 KiB bounds it far above that.
FABRIC_HANDLE_NBYTES = 64
MAX_JOIN_INFO_NBYTES = 4096
# NOTE: votes carry small config-like values; a deeper value is a bug or an attempt to blow the stack.
MAX_VALUE_DEPTH = 8

HANDLE_KINDS = ("fabric", "posix", "memfd")
BACKENDS = ("cuda", "host")

_ENVELOPE = ("kind", "v")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_TYPE_NAMES = {
    type(None): "None",
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    bytes: "bytes",
    list: "list",
    tuple: "list",
    dict: "map",
}


# ---------------------------------------------------------------------------------------------------
# checks: each takes a value and the field's path, returns the value typed, or raises WireError


def _tn(value: object) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _show(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bad(path: str, expected: str, value: object) -> WireError:
    return WireError(f"field '{path}': expected {expected}, got {_tn(value)}")


def _as_int(value: object, path: str, lo: int | None = None) -> int:
    if type(value) is not int:
        raise _bad(path, "int", value)
    if lo is not None and value < lo:
        raise WireError(f"field '{path}': expected int >= {lo}, got {value}")
    return value


def _as_float(value: object, path: str) -> float:
    """A finite float; a msgpack int is accepted and converted (senders may round timings)."""
    if type(value) is int:
        value = float(value)
    if type(value) is not float:
        raise _bad(path, "float", value)
    if not math.isfinite(value):
        raise WireError(f"field '{path}': expected a finite float, got {value}")
    return value


def _as_str(value: object, path: str, choices: tuple[str, ...] = ()) -> str:
    if type(value) is not str:
        raise _bad(path, "str", value)
    if choices and value not in choices:
        raise WireError(f"field '{path}': expected one of {', '.join(choices)}, got {_show(value)}")
    return value


def _as_bytes(value: object, path: str, nbytes: int) -> bytes:
    if type(value) is not bytes:
        raise _bad(path, f"{nbytes} bytes", value)
    if len(value) != nbytes:
        raise WireError(f"field '{path}': expected {nbytes} bytes, got {len(value)} bytes")
    return value


def _as_blob_map(value: object, path: str, max_nbytes: int) -> dict[str, bytes]:
    """{str: bytes} with every value at most `max_nbytes` long (empty is fine)."""
    out = {}
    for k, v in _as_map(value, path).items():
        where = f"{path}[{_show(k)}]"
        if type(v) is not bytes:
            raise _bad(where, f"at most {max_nbytes} bytes", v)
        if len(v) > max_nbytes:
            raise WireError(f"field '{where}': expected at most {max_nbytes} bytes, got {len(v)} bytes")
        out[k] = v
    return out


def _as_list(value: object, path: str) -> list[Any]:
    if type(value) is not list:
        raise _bad(path, "list", value)
    return value


def _as_map(value: object, path: str) -> dict[str, Any]:
    """A map whose keys are all str."""
    if type(value) is not dict:
        raise _bad(path, "map", value)
    for key in value:
        if type(key) is not str:
            raise WireError(f"field '{path}': expected str keys, got {_tn(key)} key {_show(key)}")
    return value


def _as_float_map(value: object, path: str) -> dict[str, float]:
    return {k: _as_float(v, f"{path}[{_show(k)}]") for k, v in _as_map(value, path).items()}


_SCALARS = frozenset((type(None), bool, int, float, str, bytes))


def _as_plain(value: object, path: str, depth: int = 0) -> Any:
    """Any msgpack value of at most MAX_VALUE_DEPTH nested lists/maps; returns it canonical:
    tuples become lists, maps are sorted by key (so encoding is deterministic)."""
    if type(value) in _SCALARS:
        return value
    if type(value) not in (list, tuple, dict):
        raise _bad(path, "None, bool, int, float, str, bytes, list or map", value)
    if depth >= MAX_VALUE_DEPTH:
        raise WireError(f"field '{path}': nested deeper than {MAX_VALUE_DEPTH} levels of lists/maps")
    if isinstance(value, (list, tuple)):
        return _as_plains(value, path, depth + 1)
    mapping = _as_map(value, path)
    return {k: _as_plain(mapping[k], f"{path}[{_show(k)}]", depth + 1) for k in sorted(mapping)}


def _as_plains(values: list[Any] | tuple[Any, ...], path: str, depth: int = 0) -> list[Any]:
    """[_as_plain(v, f"{path}[{i}]") for each v]. NOTE: an element's path is made only for a nested one: a decision
    of a job's W ranks is checked where it is built and where it arrives, and a string per scalar was most of that."""
    return [v if type(v) in _SCALARS else _as_plain(v, f"{path}[{i}]", depth) for i, v in enumerate(values)]


def _fields(body: object, names: tuple[str, ...], prefix: str) -> dict[str, Any]:
    """The map `body` with exactly the fields `names`: no unknown field, none missing."""
    if type(body) is dict and body.keys() == _name_set(names):  # exactly the fields (every valid message): one test
        return body
    where = prefix.rstrip(".") or "message"
    if type(body) is not dict:
        raise WireError(f"'{where}': expected map, got {_tn(body)}")
    unknown = [key for key in body if key not in names]
    if unknown:
        shown = ", ".join(_show(prefix + k if type(k) is str else k) for k in unknown[:5])
        raise WireError(f"unknown field{'s' if len(unknown) > 1 else ''} {shown}")
    missing = [name for name in names if name not in body]
    if missing:
        shown = ", ".join(repr(prefix + name) for name in missing)
        raise WireError(f"missing field{'s' if len(missing) > 1 else ''} {shown}")
    return body


_NAMES: dict[type, tuple[str, ...]] = {}
_NAME_SETS: dict[tuple[str, ...], frozenset[str]] = {}


def _name_set(names: tuple[str, ...]) -> frozenset[str]:
    found = _NAME_SETS.get(names)
    if found is None:
        found = _NAME_SETS[names] = frozenset(names)
    return found


def _names(cls: type) -> tuple[str, ...]:
    """The fields of message class `cls`, in order (kept: dataclasses.fields() took ~2 us of every decode)."""
    found = _NAMES.get(cls)
    if found is None:
        found = _NAMES[cls] = tuple(f.name for f in fields(cls))
    return found


# ---------------------------------------------------------------------------------------------------
# nested values


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    """Which device a rank drives. `ordinal` is the CUDA ordinal (or the rank on the host backend),
    `pci_bus` like "0000:1b:00.0", `numa_node` -1 when unknown."""

    ordinal: int
    uuid: str
    pci_bus: str
    numa_node: int

    def to_body(self) -> dict[str, Any]:
        return {
            "ordinal": self.ordinal,
            "uuid": self.uuid,
            "pci_bus": self.pci_bus,
            "numa_node": self.numa_node,
        }

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        b = _fields(body, _names(cls), prefix)
        return cls(
            ordinal=_as_int(b["ordinal"], prefix + "ordinal", lo=0),
            uuid=_as_str(b["uuid"], prefix + "uuid"),
            pci_bus=_as_str(b["pci_bus"], prefix + "pci_bus"),
            numa_node=_as_int(b["numa_node"], prefix + "numa_node", lo=-1),
        )


@dataclass(frozen=True, slots=True)
class BufferOffer:
    """One exported buffer: `nbytes` long, shared by `handle` ("fabric": the 64-byte `fabric` handle;
    "posix"/"memfd": an fd served on the rank's fd socket, `fabric` None)."""

    name: str
    nbytes: int
    handle: str
    fabric: bytes | None

    def to_body(self) -> dict[str, Any]:
        return {"name": self.name, "nbytes": self.nbytes, "handle": self.handle, "fabric": self.fabric}

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        b = _fields(body, _names(cls), prefix)
        handle = _as_str(b["handle"], prefix + "handle", HANDLE_KINDS)
        fabric: bytes | None = None
        if handle == "fabric":
            fabric = _as_bytes(b["fabric"], prefix + "fabric", FABRIC_HANDLE_NBYTES)
        elif b["fabric"] is not None:
            raise _bad(prefix + "fabric", f"None for a {handle} handle", b["fabric"])
        return cls(
            name=_as_str(b["name"], prefix + "name"),
            nbytes=_as_int(b["nbytes"], prefix + "nbytes", lo=0),
            handle=handle,
            fabric=fabric,
        )


# ---------------------------------------------------------------------------------------------------
# messages


@dataclass(frozen=True, slots=True)
class _Message:
    """Shared envelope: every message is one msgpack map {kind, v, token, ...fields}."""

    KIND: ClassVar[str]
    token: str

    def _payload(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_body(self) -> dict[str, Any]:
        """The map that goes on the wire: kind, v, token, then the fields, maps sorted by key."""
        return {"kind": self.KIND, "v": PROTOCOL_VERSION, "token": self.token, **self._payload()}

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        """Check `body` (the wire map without kind and v) and build the message; raises WireError."""
        raise NotImplementedError

    def to_msgpack(self, limit: int = MAX_MESSAGE_NBYTES) -> bytes:
        """The wire bytes. Raises WireError when the peer would refuse them (a field out of range,
        a wrong type, over `limit` bytes), so a bad message fails where it is built."""
        try:
            body = self.to_body()
            type(self).from_body({k: v for k, v in body.items() if k not in _ENVELOPE})
            data: bytes = msgpack.packb(body, use_bin_type=True)
        except WireError as e:
            raise WireError(f"cannot encode {self.KIND}: {e.reason}") from None
        except (AttributeError, TypeError, ValueError, OverflowError) as e:
            raise WireError(f"cannot encode {self.KIND}: {type(e).__name__}: {_show(str(e), 200)}") from None
        if len(data) > limit:
            raise WireError(f"cannot encode {self.KIND}: {len(data)} bytes exceeds the limit of {limit} bytes")
        return data


@dataclass(frozen=True, slots=True)
class Offer(_Message):
    """rank -> head: who this rank is, what it exports (docs/design.md section 5). `host` is the boot id, `manifest`
    the manifest's sha256 hex, `groups` {group name: join info} for the groups whose member 0 is this
    rank (opaque bytes the collectives of the group need to join it, at most MAX_JOIN_INFO_NBYTES;
    empty when they need none), `timings` {phase: seconds}. `manifest_path`: the file the rank loaded its manifest
    from, absolute ("" for the built-in default), which a head given none loads too and messages name."""

    KIND: ClassVar[str] = "offer"
    rank: int
    world_size: int
    host: str
    pid: int
    uid: int
    device: DeviceIdentity
    backend: str
    manifest: str
    fd_socket: str
    buffers: tuple[BufferOffer, ...]
    groups: dict[str, bytes]
    timings: dict[str, float]
    manifest_path: str = ""

    def _payload(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": self.host,
            "pid": self.pid,
            "uid": self.uid,
            "device": self.device.to_body(),
            "backend": self.backend,
            "manifest": self.manifest,
            "fd_socket": self.fd_socket,
            "buffers": [b.to_body() for b in self.buffers],
            "groups": dict(sorted(self.groups.items())),
            "timings": _timings_body(self.timings),
            "manifest_path": self.manifest_path,
        }

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        b = _fields(body, _names(cls), prefix)
        p = prefix
        rank = _as_int(b["rank"], p + "rank", lo=0)
        world_size = _as_int(b["world_size"], p + "world_size", lo=1)
        if rank >= world_size:
            raise WireError(f"field '{p}rank': expected int < world_size {world_size}, got {rank}")
        manifest = _as_str(b["manifest"], p + "manifest")
        if not _SHA256_HEX.fullmatch(manifest):
            raise WireError(f"field '{p}manifest': expected 64 lowercase hex chars, got {_show(manifest)}")
        buffers = _as_list(b["buffers"], p + "buffers")
        return cls(
            token=_as_str(b["token"], p + "token"),
            rank=rank,
            world_size=world_size,
            host=_as_str(b["host"], p + "host"),
            pid=_as_int(b["pid"], p + "pid", lo=1),
            uid=_as_int(b["uid"], p + "uid", lo=0),
            device=DeviceIdentity.from_body(_as_map(b["device"], p + "device"), prefix=p + "device."),
            backend=_as_str(b["backend"], p + "backend", BACKENDS),
            manifest=manifest,
            fd_socket=_as_str(b["fd_socket"], p + "fd_socket"),
            buffers=tuple(
                BufferOffer.from_body(_as_map(x, f"{p}buffers[{i}]"), prefix=f"{p}buffers[{i}].")
                for i, x in enumerate(buffers)
            ),
            groups=_as_blob_map(b["groups"], p + "groups", MAX_JOIN_INFO_NBYTES),
            timings=_as_float_map(b["timings"], p + "timings"),
            manifest_path=_as_str(b["manifest_path"], p + "manifest_path"),
        )


def joins_of(offers: Iterable[Offer]) -> dict[int, dict[str, bytes]]:
    """The join info that `offers` carry, non-empty only: rank -> {group: info}. What another node's ranks use of
    these offers: their buffers map within a node only, and an empty join info reads as none."""
    out = {}
    for o in offers:
        infos = {k: v for k, v in o.groups.items() if v}
        if infos:
            out[o.rank] = infos
    return out


def joins_to_wire(joins: dict[int, dict[str, bytes]]) -> list[list[Any]]:
    """`joins` on the wire: [[rank, {group: info}], ...] in rank order (msgpack map keys are strings here)."""
    return [[r, {k: joins[r][k] for k in sorted(joins[r])}] for r in sorted(joins)]


def joins_from_wire(value: object, path: str) -> dict[int, dict[str, bytes]]:
    """joins_to_wire's inverse, checked: ranks >= 0, increasing; every info at most MAX_JOIN_INFO_NBYTES."""
    out: dict[int, dict[str, bytes]] = {}
    last = -1
    for i, pair in enumerate(_as_list(value, path)):
        q = f"{path}[{i}]"
        if type(pair) is not list or len(pair) != 2:
            raise _bad(q, "[rank, map]", pair)
        rank = _as_int(pair[0], q + "[0]", lo=0)
        if rank <= last:
            raise WireError(f"field '{q}[0]': ranks in increasing order, got {rank} after {last}")
        last = rank
        out[rank] = _as_blob_map(pair[1], q + "[1]", MAX_JOIN_INFO_NBYTES)
    return out


@dataclass(frozen=True, slots=True)
class Table(_Message):
    """head -> every rank: the offers of the head's ranks (every rank of a tray of one host), in rank order, after
    the head checked them; in a job of several nodes, `joins` the join info that ranks of other nodes offered
    (rank -> {group: info}, non-empty only), which is all its ranks use of them (wire.joins_of). Nested offers
    go on the wire without kind, v and token; they carry the table's token."""

    KIND: ClassVar[str] = "table"
    offers: tuple[Offer, ...]
    joins: dict[int, dict[str, bytes]] = field(default_factory=dict)

    def _index(self, rank: int) -> int:
        """Where rank `rank`'s offer is in `offers` (consecutive ranks); -1 when it is not there."""
        i = rank - self.offers[0].rank if self.offers else -1
        return i if 0 <= i < len(self.offers) else -1

    def offer(self, rank: int) -> Offer:
        """Rank `rank`'s offer; a WireError when the table holds none (a rank of another node)."""
        i = self._index(rank)
        if i < 0:
            held = f"ranks {self.offers[0].rank}..{self.offers[-1].rank}" if self.offers else "no offer"
            raise WireError(f"the table holds {held} (this node's), not rank {rank}")
        return self.offers[i]

    def join_info(self, rank: int, group: str) -> bytes:
        """What rank `rank` offered to join `group` (b"" for none), from its offer or, on another node, `joins`."""
        i = self._index(rank)
        return (self.offers[i].groups if i >= 0 else self.joins.get(rank, {})).get(group, b"")

    def _payload(self) -> dict[str, Any]:
        for i, offer in enumerate(self.offers):
            if not hmac.compare_digest(offer.token.encode(), self.token.encode()):
                raise WireError(f"field 'offers[{i}].token': differs from the table's token")
        return {"offers": [offer._payload() for offer in self.offers], "joins": joins_to_wire(self.joins)}

    @staticmethod
    def _check(offers: tuple[Offer, ...], joins: dict[int, dict[str, bytes]], prefix: str) -> None:
        """The offers' ranks consecutive (one node's), and no join info for one of them beside its offer."""
        for i, o in enumerate(offers[1:], 1):
            if o.rank != offers[0].rank + i:
                raise WireError(f"field '{prefix}offers[{i}].rank': expected {offers[0].rank + i} (one node's ranks, "
                                f"in order), got {o.rank}")
        if offers:
            inside = [r for r in joins if offers[0].rank <= r <= offers[-1].rank]
            if inside:
                raise WireError(f"field '{prefix}joins': rank {inside[0]}'s join info beside its offer")

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        b = _fields(body, _names(cls), prefix)
        token = _as_str(b["token"], prefix + "token")
        offers = []
        for i, raw in enumerate(_as_list(b["offers"], prefix + "offers")):
            p = f"{prefix}offers[{i}]"
            nested = _as_map(raw, p)
            if "token" in nested:
                raise WireError(f"field '{p}.token': nested offers carry no token (the table's applies)")
            offers.append(Offer.from_body({**nested, "token": token}, prefix=p + "."))
        joins = joins_from_wire(b["joins"], prefix + "joins")
        cls._check(tuple(offers), joins, prefix)
        return cls(token=token, offers=tuple(offers), joins=joins)


@dataclass(frozen=True, slots=True)
class Ready(_Message):
    """rank -> head: peer tables filled, collectives of every group joined; `timings` {phase: seconds}."""

    KIND: ClassVar[str] = "ready"
    rank: int
    timings: dict[str, float]

    def _payload(self) -> dict[str, Any]:
        return {"rank": self.rank, "timings": _timings_body(self.timings)}

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        b = _fields(body, _names(cls), prefix)
        return cls(
            token=_as_str(b["token"], prefix + "token"),
            rank=_as_int(b["rank"], prefix + "rank", lo=0),
            timings=_as_float_map(b["timings"], prefix + "timings"),
        )


@dataclass(frozen=True, slots=True)
class Go(_Message):
    """head -> every rank: all are ready; `t_go` is the head's time.time() when it sent go."""

    KIND: ClassVar[str] = "go"
    t_go: float

    def _payload(self) -> dict[str, Any]:
        return {"t_go": float(self.t_go) if type(self.t_go) is int else self.t_go}

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        b = _fields(body, _names(cls), prefix)
        return cls(token=_as_str(b["token"], prefix + "token"), t_go=_as_float(b["t_go"], prefix + "t_go"))


@dataclass(frozen=True, slots=True)
class ErrorReport(_Message):
    """rank -> head: this rank failed in `phase`; the exception's type name, message and traceback."""

    KIND: ClassVar[str] = "error"
    rank: int
    phase: str
    error_type: str
    message: str
    traceback: str

    def _payload(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "phase": self.phase,
            "error_type": self.error_type,
            "message": self.message,
            "traceback": self.traceback,
        }

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        b = _fields(body, _names(cls), prefix)
        p = prefix
        return cls(
            token=_as_str(b["token"], p + "token"),
            rank=_as_int(b["rank"], p + "rank", lo=0),
            phase=_as_str(b["phase"], p + "phase"),
            error_type=_as_str(b["error_type"], p + "error_type"),
            message=_as_str(b["message"], p + "message"),
            traceback=_as_str(b["traceback"], p + "traceback"),
        )


@dataclass(frozen=True, slots=True)
class Heartbeat(_Message):
    """rank -> head: alive, now in `phase`; `seq` counts up from 0."""

    KIND: ClassVar[str] = "heartbeat"
    rank: int
    phase: str
    seq: int

    def _payload(self) -> dict[str, Any]:
        return {"rank": self.rank, "phase": self.phase, "seq": self.seq}

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        b = _fields(body, _names(cls), prefix)
        return cls(
            token=_as_str(b["token"], prefix + "token"),
            rank=_as_int(b["rank"], prefix + "rank", lo=0),
            phase=_as_str(b["phase"], prefix + "phase"),
            seq=_as_int(b["seq"], prefix + "seq", lo=0),
        )


@dataclass(frozen=True, slots=True)
class Bye(_Message):
    """rank -> head: this rank finished and closes its connection."""

    KIND: ClassVar[str] = "bye"
    rank: int

    def _payload(self) -> dict[str, Any]:
        return {"rank": self.rank}

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        b = _fields(body, _names(cls), prefix)
        return cls(
            token=_as_str(b["token"], prefix + "token"), rank=_as_int(b["rank"], prefix + "rank", lo=0)
        )


@dataclass(frozen=True, slots=True)
class Vote(_Message):
    """rank -> head: this rank's `value` for (`topic`, `round`). `value` is any msgpack value (None,
    bool, int, float, str, bytes, list, map with str keys) at most MAX_VALUE_DEPTH deep; it decodes
    with lists for tuples and maps sorted by key."""

    KIND: ClassVar[str] = "vote"
    rank: int
    topic: str
    round: int
    value: Any
    wait_s: float = 60.0  # how long the rank waits for the decision before it gives the step up

    def _payload(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "topic": self.topic,
            "round": self.round,
            "value": _as_plain(self.value, "value"),
            "wait_s": float(self.wait_s),
        }

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        b = _fields(body, _names(cls), prefix)
        return cls(
            token=_as_str(b["token"], prefix + "token"),
            rank=_as_int(b["rank"], prefix + "rank", lo=0),
            topic=_as_str(b["topic"], prefix + "topic"),
            round=_as_int(b["round"], prefix + "round", lo=0),
            value=_as_plain(b["value"], prefix + "value"),
            wait_s=_as_float(b["wait_s"], prefix + "wait_s"),
        )


@dataclass(frozen=True, slots=True)
class Decision(_Message):
    """head -> every rank: the votes for (`topic`, `round`), `values[r]` from rank r."""

    KIND: ClassVar[str] = "decision"
    topic: str
    round: int
    values: tuple[Any, ...]

    def _payload(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "round": self.round,
            "values": _as_plains(self.values, "values"),
        }

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        b = _fields(body, _names(cls), prefix)
        values = _as_list(b["values"], prefix + "values")
        return cls(
            token=_as_str(b["token"], prefix + "token"),
            topic=_as_str(b["topic"], prefix + "topic"),
            round=_as_int(b["round"], prefix + "round", lo=0),
            values=tuple(_as_plains(values, prefix + "values")),
        )


@dataclass(frozen=True, slots=True)
class Reject(_Message):
    """head -> one rank: the head refused that rank's last message, for `reason`."""

    KIND: ClassVar[str] = "reject"
    reason: str

    def _payload(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def from_body(cls, body: dict[str, Any], *, prefix: str = "") -> Self:
        b = _fields(body, _names(cls), prefix)
        return cls(
            token=_as_str(b["token"], prefix + "token"), reason=_as_str(b["reason"], prefix + "reason")
        )


def _timings_body(timings: dict[str, float]) -> dict[str, Any]:
    return {k: float(v) if type(v) is int else v for k, v in sorted(timings.items())}


Message: TypeAlias = (
    Offer | Table | Ready | Go | ErrorReport | Heartbeat | Bye | Vote | Decision | Reject
)

KINDS: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (Offer, Table, Ready, Go, ErrorReport, Heartbeat, Bye, Vote, Decision, Reject)
}


def job_message_limit(world_size: int) -> int:
    """The most bytes a message with an entry per rank may take in a job of `world_size` ranks: a Table or a
    Decision (head -> rank), a JobTable or a JobDecision (root -> head). MAX_MESSAGE_NBYTES, or PER_RANK_NBYTES per
    rank where that is more. Their receivers know the job's size and decode within it; whatever a rank or a node
    sends stays within MAX_MESSAGE_NBYTES."""
    return max(MAX_MESSAGE_NBYTES, max(world_size, 1) * PER_RANK_NBYTES)


def vote_limit_nbytes(world_size: int) -> int:
    """The most wire bytes one Vote may take in a tray of `world_size` ranks. The head's Decision
    carries every rank's value in one message of at most job_message_limit(world_size); each Vote carries at
    least the envelope and topic that the Decision carries once, so N votes within this limit always
    make a Decision within it."""
    # NOTE: 64 B covers the Decision's array header and its kind name, longer than a Vote's.
    return (job_message_limit(world_size) - 64) // max(world_size, 1)


# ---------------------------------------------------------------------------------------------------
# encode / decode


def encode(msg: Message, limit: int = MAX_MESSAGE_NBYTES) -> bytes:
    """The wire bytes of `msg`: one msgpack map {kind, v, token, ...fields}; bytes as bin, nested
    values as maps, tuples as arrays, maps sorted by key, so the same message gives the same bytes.
    Raises WireError when the message would be refused by decode() (over `limit` bytes: job_message_limit for a
    message with an entry per rank)."""
    return msg.to_msgpack(limit)


def decode(data: bytes, *, token: str | None, sender: str | None = None, limit: int = MAX_MESSAGE_NBYTES) -> Message:
    """Check and decode one message. `token`: the tray's token (None: accept any); `sender`: who sent
    it (e.g. "rank-3"), named in the error; `limit`: the most bytes it may take (a rank reading its head:
    job_message_limit). Raises WireError (and nothing else) saying what was expected and what was seen; the token is
    never echoed."""
    return decode_kinds(KINDS, data, token=token, sender=sender, limit=limit)  # type: ignore[no-any-return]


def decode_kinds(kinds: dict[str, Any], data: bytes, *, token: str | None, sender: str | None = None,
                 limit: int = MAX_MESSAGE_NBYTES) -> Any:
    """`decode` over another protocol's message classes `kinds` (KIND -> class with from_body), e.g. the
    head <-> root messages of tray.handshake.jobwire: the same envelope, limits and errors."""
    try:
        return _decode(data, token, sender, kinds, limit)
    except WireError as e:
        raise WireError(e.reason, sender) from None
    except (ValueError, TypeError, OverflowError, RecursionError, UnicodeError, KeyError) as e:
        # NOTE: a belt under the checks above: a hostile message must never escape as anything else.
        raise WireError(f"malformed message ({type(e).__name__}: {_show(str(e), 200)})", sender) from None


def _decode(data: bytes, token: str | None, sender: str | None, kinds: dict[str, Any], limit: int) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {_tn(data)}")
    nbytes = len(data)
    if nbytes > limit:
        raise WireError(f"message of {nbytes} bytes exceeds the limit of {limit} bytes")
    body = _unpack(data)
    if type(body) is not dict:
        raise WireError(f"expected a map at top level, got {_tn(body)}")
    _check_version(body, sender)
    if "kind" not in body:
        raise WireError("missing field 'kind'")
    kind = body["kind"]
    if type(kind) is not str or kind not in kinds:
        raise WireError(f"unknown kind {_show(kind)}; expected one of {', '.join(sorted(kinds))}")
    _check_token(body, token)
    del body["kind"], body["v"]  # the map just unpacked is this call's own: from_body takes it without the envelope
    try:
        return kinds[kind].from_body(body)
    except WireError as e:
        raise WireError(f"{kind}: {e.reason}") from None


def _unpack(data: bytes | bytearray | memoryview) -> object:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=MAX_MESSAGE_NBYTES,
            max_bin_len=MAX_MESSAGE_NBYTES,
            max_array_len=MAX_MESSAGE_NBYTES,
            max_map_len=MAX_MESSAGE_NBYTES,
            max_ext_len=MAX_MESSAGE_NBYTES,
        )
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError, RecursionError) as e:
        detail = str(e)
        why = f"{type(e).__name__}: {_show(detail, 120)}" if detail else type(e).__name__
        raise WireError(f"not valid msgpack ({why})") from None


def _check_version(body: dict[Any, Any], sender: str | None) -> None:
    if "v" not in body:
        raise WireError("missing field 'v' (protocol version)")
    version = body["v"]
    if type(version) is not int:
        raise _bad("v", "int", version)
    if version != PROTOCOL_VERSION:
        if version > PROTOCOL_VERSION:
            act = "upgrade tray on this side"
        else:
            act = f"upgrade tray on {sender or 'the sender'}"
        raise WireError(
            f"protocol version {version}, expected {PROTOCOL_VERSION}; {act} (run one tray version everywhere)"
        )


def carries_token(data: bytes, token: str) -> bool:
    """Whether `data` (a message decode() refused) is a map whose `token` is `token`: its sender holds the tray's
    secret, so a Reject (which carries it) may go back to it. A sender that has not shown the token gets none."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > MAX_MESSAGE_NBYTES:
        return False
    try:
        body = _unpack(data)
    except WireError:
        return False
    seen = body.get("token") if type(body) is dict else None
    return type(seen) is str and hmac.compare_digest(seen.encode(), token.encode())


def _check_token(body: dict[Any, Any], token: str | None) -> None:
    if "token" not in body:
        raise WireError("missing field 'token'")
    seen = body["token"]
    if type(seen) is not str:
        raise _bad("token", "str", seen)
    if token is not None and not hmac.compare_digest(seen.encode(), token.encode()):
        raise WireError("wrong token (the sender belongs to another tray, or to an earlier one on this path)")
