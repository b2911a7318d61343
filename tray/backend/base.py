"""The backend interface: what a rank needs from a device, implemented by `host` and `cuda`.

Production code above this layer (rank lifecycle, gate, executor) never branches on the backend.
Every resource returned here has `close()`; the backend closes what it still owns in its own `close()`.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import inspect
import numbers
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tray.backend.wait import Pending
from tray.errors import UsageError

# NOTE: the barrier's default wait; the gate and docs/design.md section 6 use 2 s.
DEFAULT_BARRIER_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class DeviceInfo:
    """Identity of the device a rank drives. `numa_node` is -1 when the platform gives none."""

    ordinal: int
    uuid: str
    pci_bus: str
    numa_node: int
    name: str = ""


@dataclass(frozen=True)
class ExportedHandle:
    """How a buffer is shared. `fd` stays owned by the exporting buffer (the receiver dups or closes
    its own received copy); `fabric` is the 64-byte handle when `kind == "fabric"`."""

    kind: str  # "posix" | "memfd" | "fabric"
    nbytes: int
    fd: int | None = None
    fabric: bytes | None = None


@dataclass(frozen=True)
class GroupInfo:
    """One group instance as this rank sees it: `members` are global ranks in member order."""

    name: str
    members: tuple[int, ...]
    index: int  # this rank's position in `members`

    @property
    def size(self) -> int:
        return len(self.members)


class DeviceBuffer(abc.ABC):
    """A buffer owned by this rank. `ptr` is its address in this process (device VA on cuda)."""

    name: str
    nbytes: int
    ptr: int

    @abc.abstractmethod
    def handle(self) -> ExportedHandle:
        """The shareable handle; raises UsageError if the buffer was not allocated exportable."""

    @abc.abstractmethod
    def close(self) -> None: ...


class PeerMapping(abc.ABC):
    """A peer's buffer mapped into this process. `ptr` is usable by this rank's device."""

    ptr: int
    nbytes: int

    @abc.abstractmethod
    def close(self) -> None: ...

    def holds(self, nbytes: int, what: str) -> None:
        """The buffer is the first `nbytes` of the mapping (the rest is the exporter's rounding), named `what`
        in errors. Backends that judge accesses (the host backend's twins) check against it; others ignore it."""
        return None


class PtrTable(abc.ABC):
    """A `u64[G]` array of peer addresses in member order, living where kernels can read it."""

    ptr: int
    ptrs: tuple[int, ...]

    @abc.abstractmethod
    def close(self) -> None: ...


class HostMemory(abc.ABC):
    """Host memory a device can copy to and from at full speed (pinned on cuda)."""

    ptr: int
    nbytes: int
    numa_node: int

    @abc.abstractmethod
    def close(self) -> None: ...


def seal(obj: Any, what: str, names: Sequence[str]) -> None:
    """Make each call `names` of `obj` raise UsageError naming `what` from now on, rather than use memory, flags or a
    communicator its rank's close() released (on the host backend a barrier read unmapped flags: SIGSEGV). An
    attribute of the instance over the class's method: the calls of an open object cost nothing more."""

    def closed(*args: Any, **kwargs: Any) -> Any:
        raise UsageError(f"{what}: used after close() of its rank (rank.close(), or the end of the `with tray.init()` "
                         "block), which released what it uses; make every call before closing, or keep the rank "
                         "open")

    for name in names:
        obj.__dict__[name] = closed


def remember_bound(kernel: Any, bound: Any) -> Any:
    """`bound` (a launch `kernel.bind` made) noted on `kernel`, weakly, so that seal_kernel reaches it too."""
    found = kernel.__dict__.get("_tray_bound")
    if found is None:
        found = kernel.__dict__["_tray_bound"] = weakref.WeakSet()
    found.add(bound)
    return bound


def seal_kernel(kernel: Any, name: str) -> None:
    """A kernel its rank closed: its bind and launch, and the launch of every bound launch it made that still lives
    (a hot loop's, kept past close()), raise UsageError (on the host a twin would write through unmapped peers)."""
    seal(kernel, f"kernel {name!r}", ("bind", "launch"))
    for bound in list(kernel.__dict__.get("_tray_bound", ())):
        seal(bound, f"a launch of kernel {name!r} bound before", ("launch",))


def _sealing_on_close(cls: type, names: Sequence[str], what: Callable[[Any], str]) -> None:
    """`cls.close` (where `cls` defines one) followed, whatever it raises, by seal(): a barrier's or collectives'
    object kept past its rank's close() says so when used."""
    close = cls.__dict__.get("close")
    if close is None or getattr(close, "__isabstractmethod__", False) or getattr(close, "_tray_seals", False):
        return

    @functools.wraps(close)
    def closing(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return close(self, *args, **kwargs)
        finally:
            seal(self, what(self), names)

    closing._tray_seals = True  # type: ignore[attr-defined]
    cls.close = closing  # type: ignore[attr-defined]


def _group_name(obj: Any) -> str:
    group = getattr(obj, "group", None)
    return repr(getattr(group, "name", "?"))


_BARRIER_CALLS = ("launch", "check", "wait", "synchronize")


class Barrier(abc.ABC):
    """The peer barrier of one group (docs/design.md section 6). Epochs come from a counter the barrier
    keeps itself, so a captured sequence replays with fresh epochs."""

    group: GroupInfo
    # which barrier runs: "peer" (within one node), or over a group that spans nodes "hierarchical"
    # (tray/collectives/span.py) or "relayed" (through the job's root, tray/collectives/relay.py)
    path: str = "peer"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _sealing_on_close(cls, _BARRIER_CALLS, lambda b: f"the barrier of group {_group_name(b)}")

    @abc.abstractmethod
    def launch(self, timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S, stream: int | None = None) -> None:
        """Enqueue one barrier on the rank's stream, or on `stream` (an int CUDA stream handle) when given
        (host: run it now). May return before it ends; no allocation or synchronisation (capturable)."""

    @abc.abstractmethod
    def check(self) -> None:
        """After a synchronisation: raise BarrierTimeout if any launched barrier timed out."""

    def wait(self, timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S) -> None:
        """One barrier, synchronised and checked."""
        self.launch(timeout_s)
        self.synchronize()
        self.check()

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class Timer(abc.ABC):
    """Times work on the rank's stream: device events on cuda, a host clock on host."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    @abc.abstractmethod
    def elapsed_s(self) -> float:
        """Seconds between start and stop; synchronises as needed."""


class Graph(abc.ABC):
    """A captured sequence of stream work, replayed as one unit."""

    @abc.abstractmethod
    def replay(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


def address(x: Any, what: str, device: bool = False) -> int:
    """`x` as an address: an int (numpy's too), a tray view (`.ptr`: rank.buffer(), rank.peer_view()), a tensor
    (`data_ptr()`), or an array (`__cuda_array_interface__`, `__array_interface__`). With `device` (NCCL's
    collectives), memory that says it is on the host (a numpy array, a CPU tensor) is refused: the device would
    fault on it. UsageError otherwise."""
    if type(x) is int:
        return x
    if isinstance(x, bool):
        raise UsageError(f"{what}: expected an address, got {x!r}")
    if isinstance(x, numbers.Integral):  # NOTE: before the interfaces: a numpy integer has __array_interface__ too
        return int(x)
    ptr = getattr(x, "ptr", None)
    if type(ptr) is int:
        return ptr
    data_ptr = getattr(x, "data_ptr", None)
    if callable(data_ptr):
        if device and getattr(x, "is_cuda", True) is False:
            raise _host_memory(what, "a tensor on the host")
        is_contiguous = getattr(x, "is_contiguous", None)
        if callable(is_contiguous) and not is_contiguous() and not _dense_format(x):
            raise _strided(what, "tensor", tuple(x.shape), tuple(x.stride()), "elements")
        return int(data_ptr())
    iface = getattr(x, "__cuda_array_interface__", None)
    if isinstance(iface, dict) and isinstance(iface.get("data"), tuple):
        _check_c_contiguous(iface, what)
        return int(iface["data"][0])
    iface = getattr(x, "__array_interface__", None)
    if isinstance(iface, dict) and isinstance(iface.get("data"), tuple):
        if iface.get("shape") == ():  # a numpy scalar or 0-d array: its own few bytes, not a buffer
            raise UsageError(f"{what}: a scalar ({type(x).__name__}), not memory; pass an address, a view or an array")
        if device:
            raise _host_memory(what, "an array in host memory")
        _check_c_contiguous(iface, what)
        return int(iface["data"][0])
    raise UsageError(f"{what}: expected an address (an int, e.g. rank.buffer('x').ptr), a tray view, or a tensor or "
                     f"array over tray memory; got {type(x).__name__}")


def _dense_format(x: Any) -> bool:
    """Whether tensor `x` is dense in one of torch's other memory formats (channels_last, channels_last_3d): its
    elements fill the memory from its first one on without gaps, as a conv's weights and gradients are kept; the
    collectives took them before contiguity was checked (elementwise, send and recv of one format)."""
    torch = sys.modules.get("torch")
    for name in ("channels_last", "channels_last_3d"):
        fmt = getattr(torch, name, None)
        if fmt is None:
            continue
        try:
            if x.is_contiguous(memory_format=fmt):
                return True
        except (TypeError, RuntimeError):
            return False
    return False


def _strided(what: str, kind: str, shape: tuple, strides: tuple, unit: str) -> UsageError:
    if what.endswith("recv_ptr"):  # a copy given to be written takes the result, and the caller's object does not
        fix = (f"receive into a contiguous {kind} (or a view of a tray buffer) and copy that into this one "
               "(x.copy_(out), x[...] = out): a .contiguous() copy given here would take the result in its place")
    else:
        fix = "pass a contiguous one (.contiguous() or np.ascontiguousarray copy it) or a view of a tray buffer"
    return UsageError(f"{what}: a non-contiguous {kind} (shape {list(shape)}, strides {list(strides)} {unit}); the "
                      "collectives take memory from its first element on, without gaps, so they would read or write "
                      f"other elements than its own: {fix}")


def _check_c_contiguous(iface: dict, what: str) -> None:
    """UsageError unless an array interface describes C-contiguous memory (strides None, or the C order's)."""
    strides, shape = iface.get("strides"), iface.get("shape")
    if strides is None or not isinstance(shape, tuple):
        return
    try:
        expect = int(str(iface.get("typestr", ""))[2:])  # "<f4": 4 B per element
    except ValueError:
        return
    for n, stride in zip(reversed(shape), reversed(strides)):
        if n != 1 and stride != expect:
            raise _strided(what, "array", shape, tuple(strides), "B")
        expect *= n


def _host_memory(what: str, which: str) -> UsageError:
    return UsageError(f"{what}: {which}; these collectives move device memory: pass a view of a tray buffer "
                      "(rank.buffer(name)), a tensor on the GPU, or its address")


# the collectives' address arguments: each may be given as address() takes it
_ADDRESS_ARGS = {"allreduce": 2, "allgather": 2, "reducescatter": 2, "alltoall": 2, "alltoall_among": 2,
                 "sendrecv": 2, "send": 1, "recv": 1, "register_window": 1}
# what a closed group's collectives refuse
_COLLECTIVE_CALLS = (*_ADDRESS_ARGS, "batch")


def _taking_addresses(fn: Callable[..., Any], n: int, device: bool, op: str = "") -> Callable[..., Any]:
    """`fn` with its first `n` named arguments after self given as address() takes them. Made with `fn`'s own
    parameters where they are plain (no *args to pack), so ints cost one call and a type check each (53 ns on the
    CPU of bench/results/host/address_cost.json).
    A method that takes *args (delegating to another, say) is left as it is: the one it calls converts. `op`: the
    collective's name (its attribute's), which says what typed objects given to it must hold (check_typed)."""
    op = op or fn.__name__
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    named = [p for p in params[1:n + 1] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(named) < n:
        return fn
    taken = [p.name for p in named]
    # NOTE: a parameter named as the wrapper's own names would be overwritten by them: the general path then
    if any(p.kind is not p.POSITIONAL_OR_KEYWORD or p.name.startswith("_tray_") for p in params):
        def general(self: Any, *args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(self, *args, **kwargs)  # NOTE: args and kwargs keep the objects given alive
            objs = tuple(bound.arguments.get(a) for a in taken)
            for a in taken:
                if a in bound.arguments:
                    bound.arguments[a] = address(bound.arguments[a], f"{fn.__name__} {a}", device)
            check_typed(self, op, tuple(taken), objs, bound.arguments.get("count"), bound.arguments.get("dtype"))
            return fn(*bound.args, **bound.kwargs)

        return functools.wraps(fn)(general)
    ns: dict[str, Any] = {"_tray_fn": fn, "_tray_address": address, "_tray_device": device, "_tray_type": type,
                          "_tray_int": int}
    decl = []
    for i, p in enumerate(params):
        if p.default is p.empty:
            decl.append(p.name)
        else:
            ns[f"_tray_default{i}"] = p.default
            decl.append(f"{p.name}=_tray_default{i}")
    ns["_tray_typed"] = check_typed
    # NOTE: each address goes to a local of its own, never into the parameter: the parameter holds the caller's
    # object (a temporary tensor, `c.allreduce(x.contiguous(), ...)`) until the call returns, where rebinding it
    # freed the tensor before the collective read it (the callee owns its arguments' references)
    fixes = "".join(f"        _tray_a{i} = _tray_address({a}, {fn.__name__ + ' ' + a!r}, _tray_device)\n"
                    for i, a in enumerate(taken))
    names = {p.name for p in params}
    objs = "".join(a + ", " for a in taken)
    typed = (f"        _tray_typed({params[0].name}, {op!r}, {tuple(taken)!r}, ({objs}), "
             f"{'count' if 'count' in names else 'None'}, {'dtype' if 'dtype' in names else 'None'})\n")
    converted = ", ".join(f"_tray_a{taken.index(p.name)}" if p.name in taken else p.name for p in params)
    src = (f"def _tray_wrapped({', '.join(decl)}):\n"
           f"    if {' or '.join(f'_tray_type({a}) is not _tray_int' for a in taken)}:\n{fixes}{typed}"
           f"        return _tray_fn({converted})\n"
           f"    return _tray_fn({', '.join(p.name for p in params)})\n")
    # NOTE: source made here from fn's parameter names alone, compiled under a name that says where it comes from
    exec(compile(src, f"<tray.backend.base: addresses of {fn.__qualname__}>", "exec"), ns)
    return functools.wraps(fn)(ns["_tray_wrapped"])


# what each collective reads from its send address and writes at its receive one: `count` elements (1), or a block of
# `count` per member of the group (0); a reduction's elements are added as `dtype`, so a typed object must hold those
_EXTENTS = {"allreduce": (1, 1), "allgather": (1, 0), "reducescatter": (0, 1), "alltoall": (0, 0), "sendrecv": (1, 1),
            "send": (1,), "recv": (1,)}
_REDUCING = ("allreduce", "reducescatter")
_SIDES = {"send_ptr": "send", "recv_ptr": "receive"}
_OWN_SIDE = {"send": "send", "recv": "receive"}  # send(ptr, ...) reads at ptr, recv(ptr, ...) writes there
_ELEMENTS: dict[str, tuple[str, int]] = {}  # a manifest dtype -> its numpy name and size (kept: ~1 us each to ask)


def _element(dtype: str) -> tuple[str, int] | None:
    found = _ELEMENTS.get(dtype)
    if found is None:
        try:
            np_dtype = numpy_dtype(dtype)
        except Exception:  # the collective names a bad dtype itself
            return None
        found = _ELEMENTS[dtype] = (np_dtype.name, np_dtype.itemsize)
    return found


_ELEMENT_NAMES: dict[Any, str] = {}  # a tensor's or array's dtype object -> its element type's numpy name


def _element_name(dtype: Any) -> str:
    """torch.float32 -> "float32", np.dtype("float32") -> "float32" (kept: numpy's dtype.name builds its string at
    every ask)."""
    try:
        return _ELEMENT_NAMES[dtype]
    except (KeyError, TypeError):  # not asked yet, or unhashable
        pass
    name = dtype.name if isinstance(dtype, np.dtype) else str(dtype).rpartition(".")[2]
    with contextlib.suppress(TypeError):
        _ELEMENT_NAMES[dtype] = name
    return name


def _typed_extent(x: Any) -> tuple[int | None, str | None, str] | None:
    """What an object given as an address says of itself: (its bytes, or None for a tray view, whose range the
    backend checks against the buffer it lies in; its element type's numpy name, or None; what it is); None for
    what says nothing (an int, numpy's too)."""
    if type(x) is int:
        return None
    data_ptr = getattr(x, "data_ptr", None)
    if callable(data_ptr):  # a tensor
        try:
            return int(x.numel()) * int(x.element_size()), _element_name(x.dtype), "tensor"
        except Exception:
            return None
    if isinstance(x, (np.integer, numbers.Integral)):
        return None
    dtype = getattr(x, "dtype", None)
    if type(getattr(x, "ptr", None)) is int:  # a tray view: a manifest dtype name
        element = _element(dtype) if isinstance(dtype, str) else None
        return None, element[0] if element else None, "tray view"
    nbytes = getattr(x, "nbytes", None)
    if isinstance(dtype, np.dtype) and type(nbytes) is int:  # a numpy (or cupy) array
        return nbytes, _element_name(dtype), "array"
    return None


def check_typed(coll: Any, op: str, names: tuple[str, ...], objs: tuple[Any, ...], count: Any, dtype: Any) -> None:
    """Refuse, naming it, a typed object (a tensor, an array, a tray view) given to collective `op` whose element type
    is not `dtype` in a reduction (its bytes would be added as `dtype`), or that is smaller than what the collective
    reads or writes there. Bad counts and dtypes are left to the collective's own checks."""
    if type(count) is not int and (isinstance(count, bool) or not isinstance(count, numbers.Integral)):
        return
    if count < 0 or type(dtype) is not str:
        return
    want = _element(dtype)
    if want is None:
        return
    count = int(count)
    extents = _EXTENTS.get(op)
    for i, (name, obj) in enumerate(zip(names, objs)):
        typed = _typed_extent(obj)
        if typed is None:
            continue
        nbytes, element, kind = typed
        side = _SIDES.get(name) or _OWN_SIDE.get(op, name)
        if op in _REDUCING and element is not None and element != want[0]:
            fix = f"pass dtype {TRAY_NAMES[element]!r}, or a {dtype} {kind}" if element in TRAY_NAMES else \
                f"pass a {dtype} {kind}"
            raise UsageError(f"{op} of {count} {dtype}: its {side} is a {element} {kind}, whose elements it would add "
                             f"as {dtype}: {fix}; to reduce its bytes as {dtype} elements on purpose, reinterpret it "
                             "first (tensor.view(dtype), array.view(dtype)) or pass its address (data_ptr(), .ptr)")
        if nbytes is not None and extents is not None and i < len(extents):
            per = 1 if extents[i] else int(getattr(getattr(coll, "group", None), "size", 1))
            need = count * want[1] * per
            if need > nbytes:
                blocks = "" if extents[i] else f" ({per} blocks of {count}, one per member)"
                raise UsageError(f"{op} of {count} {dtype}: its {side} is a {element} {kind} of {nbytes} B, and the "
                                 f"collective {'reads' if side == 'send' else 'writes'} {need} B there{blocks}: pass "
                                 f"a count that fits it, or a larger {kind}")


class Collectives(abc.ABC):
    """Collectives of one group on raw addresses (made by tray.collectives: NCCL on cuda, shared memory
    on host).

    `count` is in elements of `dtype` (a numpy dtype name or "bf16"); for allgather and alltoall
    `count` is the per-member chunk. All calls are enqueued on the rank's stream, or on `stream` (an int
    CUDA stream handle; host: ignored) when given; none synchronises, so a caller's capture records them.
    """

    group: GroupInfo

    # whether these collectives move device memory only (NCCL): host memory passed to them is refused
    device_memory: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, n in _ADDRESS_ARGS.items():
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "__isabstractmethod__", False):
                setattr(cls, name, _taking_addresses(fn, n, cls.device_memory, name))
        _sealing_on_close(cls, _COLLECTIVE_CALLS, lambda c: f"the collectives of group {_group_name(c)}")

    @abc.abstractmethod
    def allreduce(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                      stream: int | None = None) -> None: ...

    @abc.abstractmethod
    def allgather(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                      stream: int | None = None) -> None: ...

    @abc.abstractmethod
    def reducescatter(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                          stream: int | None = None) -> None: ...

    @abc.abstractmethod
    def alltoall(self, send_ptr: int, recv_ptr: int, count: int, dtype: str,
                     stream: int | None = None) -> None: ...

    @abc.abstractmethod
    def sendrecv(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, peer_index: int,
                 stream: int | None = None) -> None:
        """Send `count` elements to member `peer_index` and receive as many from it; both make the call, with the
        same count and dtype, and only the pair takes part."""

    def alltoall_among(self, send_ptr: int, recv_ptr: int, count: int, dtype: str, members: Sequence[int],
                       stream: int | None = None) -> None:
        """alltoall's blocks between this rank and the member indices `members` only (every one of them
        names this rank in its own call): send block i to member i, receive member i's block into
        recv block i; the other blocks are left as they are. Raises UsageError where the collectives
        cannot (the groups within one node: their peer kernels write there directly)."""
        raise UsageError(f"group {self.group.name!r}: the collectives of this group cannot move a subset of an "
                         "alltoall (only those of a group spanning nodes can)")

    def register_window(self, ptr: int, nbytes: int) -> None:
        """Register `nbytes` at `ptr` (this rank's buffer; every member passes one of the same size, at the same
        step) as a symmetric window of this group, so collectives whose buffers all lie in such windows, at the
        same offsets on every member, may run the library's window kernels (NCCL 2.27 and later:
        ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC). A group-wide step that blocks until every member
        has registered: make a bounded tray-wide step first (`rank.exchange`, which names a rank that never
        comes). The windows are deregistered when the collectives close. UsageError where these collectives have
        no windows."""
        raise UsageError(f"group {self.group.name!r}: these collectives have no windows (NCCL 2.27 or later, "
                         "cuda backend)")

    def send(self, ptr: int, count: int, dtype: str, peer_index: int, stream: int | None = None) -> None:
        """NCCL's point-to-point send (cuda); UsageError where these collectives have none."""
        raise UsageError(self._no_point_to_point("send"))

    def recv(self, ptr: int, count: int, dtype: str, peer_index: int, stream: int | None = None) -> None:
        """NCCL's point-to-point receive (cuda); UsageError where these collectives have none."""
        raise UsageError(self._no_point_to_point("recv"))

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """NCCL's group of calls (cuda); UsageError where these collectives have none."""
        raise UsageError(self._no_point_to_point("batch"))

    def _no_point_to_point(self, call: str) -> str:
        return (f"group {self.group.name!r}: {call}() is NCCL's (cuda backend); these "
                "collectives have no point-to-point calls: use sendrecv(send, recv, count, dtype, peer_index), which "
                "both members of the pair call")

    @abc.abstractmethod
    def close(self) -> None: ...


class BoundLaunch(abc.ABC):
    """A kernel with its arguments packed once, for hot loops and captures."""

    @abc.abstractmethod
    def launch(self) -> None: ...


def launch_dims(dims: Any, what: str, kernel: str) -> tuple[int, int, int]:
    """(x, y, z) from an int or a sequence of 1-3 ints >= 1 (a kernel's grid or block); UsageError otherwise."""
    try:
        seq = (dims,) if isinstance(dims, numbers.Integral) else tuple(dims)
        ok = 1 <= len(seq) <= 3 and all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 1
                                        for d in seq)
    except TypeError:
        ok = False
    if not ok:
        raise UsageError(f"kernel {kernel!r}: {what} must be an int or 1-3 ints, each >= 1, got {dims!r}")
    x, y, z = (tuple(int(d) for d in seq) + (1, 1))[:3]
    return x, y, z


def pointer_of(arg: Any) -> int | None:
    """The address a kernel gets for `arg` when it stands for memory: an int `.ptr` (a buffer view, a pointer table,
    a peer mapping), or a peer table's `.table_ptr` (rank.peers(name)); None for anything else (a number)."""
    if isinstance(arg, (int, float, np.generic)):
        return None
    ptr = getattr(arg, "ptr", None)
    if ptr is None:
        ptr = getattr(arg, "table_ptr", None)
    return ptr if isinstance(ptr, int) else None


def kernel_arg(arg: Any) -> Any:
    """A kernel argument as a host twin gets it: memory (pointer_of) as its address, a numpy scalar as its Python
    number, anything else as given (the cuda backend packs the same objects the same way)."""
    ptr = pointer_of(arg)
    if ptr is not None:
        return ptr
    # a numpy scalar as the Python number it holds (twins get "ints or floats"; np.uint64 arithmetic overflows)
    return arg.item() if isinstance(arg, (np.integer, np.floating, np.bool_)) else arg


class Kernel(abc.ABC):
    """A loaded kernel. Python ints and floats are packed by the parameter's size on the device
    (cuda: `cuFuncGetParamInfo`): int -> 4 or 8 bytes, float -> f32 or f64."""

    name: str

    @abc.abstractmethod
    def bind(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[Any],
        shmem_nbytes: int = 0,
        programmatic: bool = False,
    ) -> BoundLaunch: ...

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[Any],
        shmem_nbytes: int = 0,
    ) -> None:
        self.bind(grid, block, args, shmem_nbytes).launch()


class Backend(abc.ABC):
    """One rank's device. Construct with `open(ordinal)`; `close()` releases everything it made."""

    name: str
    info: DeviceInfo

    @property
    def last_work(self) -> Pending:
        """What was last enqueued on the rank's stream, in words (the executor and graph replays note it):
        a wait that times out names it."""
        found = self.__dict__.get("_tray_last_work")
        if found is None:
            found = self.__dict__["_tray_last_work"] = Pending()
        return found

    # --- memory -------------------------------------------------------------------------------
    @abc.abstractmethod
    def allocate(self, name: str, nbytes: int, export: bool) -> DeviceBuffer:
        """A zeroed buffer of at least `nbytes` (rounded up to the allocation granularity)."""

    @abc.abstractmethod
    def import_peer(self, handle: ExportedHandle) -> PeerMapping:
        """Map a peer's buffer; `handle.fd` (if any) is a received fd this call closes."""

    @abc.abstractmethod
    def ptr_table(self, ptrs: Sequence[int]) -> PtrTable: ...

    @abc.abstractmethod
    def write(self, ptr: int, data: np.ndarray) -> None:
        """Copy host bytes to `ptr` (synchronous)."""

    @abc.abstractmethod
    def read(self, ptr: int, nbytes: int) -> np.ndarray:
        """Copy `nbytes` from `ptr` into a new host u8 array (synchronous)."""

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    # --- copies, pinned host memory, GEMM ------------------------------------------------------------
    @abc.abstractmethod
    def copy(self, dst_ptr: int, src_ptr: int, nbytes: int, *, transfer: bool = False) -> None:
        """Enqueue a copy of `nbytes` (device or pinned-host addresses, either direction) on the rank's
        stream, or on its transfer stream when `transfer`; host: runs now."""

    @abc.abstractmethod
    def sync_transfer(self) -> None:
        """Wait until every copy enqueued with `transfer=True` has landed."""

    @abc.abstractmethod
    def pinned_host(self, nbytes: int) -> "HostMemory":
        """Page-locked host memory on this device's NUMA node (host backend: plain memory)."""

    @abc.abstractmethod
    def gemm(self, a_ptr: int, b_ptr: int, c_ptr: int, m: int, n: int, k: int, dtype: str = "bf16",
             accumulate: bool = False) -> None:
        """Row-major C[m, n] (+)= A[m, k] @ B[n, k]^T on the rank's stream; float32 accumulation.
        `dtype` is the element type of A, B and C ("bf16", "f16" or "f32")."""

    # --- barrier, timing, graphs ----------------------------------------------------------------
    @abc.abstractmethod
    def barrier(self, group: GroupInfo, flags: DeviceBuffer, peer_flags: PtrTable) -> Barrier:
        """The peer barrier over `flags` (own, `u64[G]`) and every member's flags (`peer_flags`)."""

    @abc.abstractmethod
    def timer(self) -> Timer: ...

    @abc.abstractmethod
    def capture(self, body: Callable[[], None]) -> Graph:
        """Record the stream work `body` enqueues; replay it later as one graph."""

    def close_graphs(self) -> None:
        """Destroy every graph `capture` made. Called before the collectives close: NCCL frees a
        communicator only once every graph that captured its work is gone. Host: nothing to destroy."""
        return None

    # --- kernels ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def load_kernel(self, name: str, code: bytes, entry: str, options: Sequence[str], peers: bool,
                    filename: str = "") -> Kernel:
        """The kernel `entry` of CUDA C source `code` (the bytes the manifest digested; the host backend
        runs the numpy twin registered under `name` instead). `filename` names the source in errors."""

    @abc.abstractmethod
    def close(self) -> None: ...

    # --- the caller's streams and views (DLPack) ------------------------------------------------------
    @property
    def dlpack_device(self) -> tuple[int, int]:
        """(DLDeviceType, ordinal) of memory this backend maps: host memory is (kDLCPU = 1, 0)."""
        return (1, 0)

    @property
    def cuda_stream(self) -> int | None:
        """The rank's stream as an int handle (None on host, which has no streams, and after close())."""
        return None

    def order_stream(self, stream: int) -> None:
        """Make the caller's `stream` wait for the work enqueued so far on the rank's stream (an event;
        no host synchronisation). Host: nothing to order."""
        return None

    @contextlib.contextmanager
    def joined(self, stream: int | None) -> Iterator[None]:
        """Work the body enqueues on the rank's stream runs after the work on `stream` and before the
        caller's next work on `stream` (events both ways; a capture on `stream` records it). Host: as is."""
        yield

    def is_capturing(self, stream: int) -> bool:
        """Whether `stream` is being captured into a CUDA graph (host: never)."""
        return False

    def detach(self, resource: DeviceBuffer | PeerMapping) -> Callable[[], None]:
        """Take `resource` (a buffer or mapping this backend made) out of `close()`: a view still uses it.
        Returns the function that releases it (and what it needs of the device) later, exactly once."""
        self._disown(resource)
        return resource.close

    def free(self, resource: Any) -> None:
        """Release `resource` (memory this backend made and tracks for `close()`, such as a `pinned_host` region)
        now, and forget it: memory made and freed over and over (a staging buffer per `load_weights()`) leaves
        nothing behind."""
        self._disown(resource)
        resource.close()

    def _disown(self, resource: DeviceBuffer | PeerMapping) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot hand out its resources")


def itemsize(dtype: str) -> int:
    """Bytes per element of a manifest dtype name."""
    return DTYPE_ITEMSIZE[dtype]


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a manifest dtype name (bf16 through ml_dtypes). Raises UsageError naming the names
    tray takes (and the one meant, for a numpy name like "float32")."""
    if isinstance(dtype, str) and dtype == "bf16":  # not `dtype == ...` alone: an array compares elementwise
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(NUMPY_NAMES[dtype])
    except (KeyError, TypeError):
        from tray.errors import UsageError

        hint = f" ({TRAY_NAMES[meant]!r} is tray's name for it)" if (meant := _dtype_name(dtype)) in TRAY_NAMES \
            else ""
        raise UsageError(f"dtype {dtype!r} is not one tray knows{hint}; it takes "
                         f"{', '.join(['bf16', *NUMPY_NAMES])}") from None


def _dtype_name(dtype: object) -> str:
    """The numpy name of what `dtype` stands for, to suggest tray's: a str as it is; a numpy type or dtype
    (np.float32, ml_dtypes.bfloat16) or a torch dtype (torch.float32) by its name; "" for anything else."""
    if isinstance(dtype, str):
        return dtype
    try:
        return np.dtype(dtype).name  # type: ignore[call-overload]
    except Exception:  # NOTE: anything may come here; a torch dtype says "torch.float32"
        text = str(dtype)
        return text.removeprefix("torch.") if text.startswith("torch.") else ""


NUMPY_NAMES = {
    "u8": "uint8", "i8": "int8", "u16": "uint16", "i16": "int16", "u32": "uint32", "i32": "int32",
    "u64": "uint64", "i64": "int64", "f16": "float16", "f32": "float32", "f64": "float64",
}
TRAY_NAMES = {v: k for k, v in NUMPY_NAMES.items()} | {"bfloat16": "bf16"}  # a numpy dtype name -> tray's
DTYPE_ITEMSIZE = {
    "u8": 1, "i8": 1, "u16": 2, "i16": 2, "u32": 4, "i32": 4, "u64": 8, "i64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
}
