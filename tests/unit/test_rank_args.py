"""A rank program's wrong arguments are UsageErrors saying what the call takes, never a TypeError, AttributeError or
ValueError from inside: a property test over odd values (None, bools, numbers, NaN, bytes, arrays, containers) for
every argument the Rank checks before it touches the tray."""

from __future__ import annotations

import math
import types
from collections.abc import Hashable

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tray.backend.base import GroupInfo, numpy_dtype
from tray.collectives.host import _count as host_count
from tray.errors import UsageError
from tray.handshake import wire
from tray.manifest import parse_manifest
from tray.park.session import _iterable
from tray.rank import Rank
from tray.rank.env import RankEnv
from tray.rank.phases import PhaseClock
from tray.rank.wiring import PeerTable, Wiring

ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.binary(max_size=4), st.complex_numbers(max_magnitude=4),
    st.sampled_from([np.int64(1), np.uint8(0), np.float32(1.5), np.bool_(True), np.array(1), np.array([1, 2]),
                     np.zeros((2, 2)), object(), (), [], {}, ["x"], {"x": 1}, 10**400]),
)
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _rank() -> Rank:
    doc = {"format": 1, "name": "w", "buffers": [{"name": "x", "dtype": "f32", "shape": [4], "export": True}],
           "states": [{"name": "kv", "page_nbytes": 4096, "pages": 2}],
           "programs": [{"name": "step", "ops": [{"op": "barrier", "group": "world"}]}]}
    resolved = parse_manifest(doc, "<test>", ".").resolve(2)
    env = RankEnv(rank=0, world_size=2, local_rank=0, device=0, endpoint="", job_dir="", token="t",
                  manifest="", backend="host", vars=(), t_spawn=None)
    world = GroupInfo("world", (0, 1), 0)
    return Rank(Wiring(env=env, phases=PhaseClock(), client=None, manifest=resolved.manifest, resolved=resolved,
                       backend=None, fd_server=None, groups={"world": world},
                       buffers={"x": types.SimpleNamespace(ptr=4096)}, ptr_tables={},
                       peer_tables={"x": PeerTable("x", world, (4096, 8192), 0)}, barriers={},
                       collectives={}))  # type: ignore[arg-type]


class _Passed(Exception):
    """Raised where a call that passed its checks would reach the backend or the head (the fake wiring has neither)."""


def _passed(*args: object, **kwargs: object) -> None:
    raise _Passed


RANK = _rank()
RANK._wiring.barriers["world"] = types.SimpleNamespace(wait=_passed, launch=_passed)  # type: ignore[index]
RANK._executor = types.SimpleNamespace(run=_passed, plan=_passed)  # type: ignore[assignment]
RANK._park = types.SimpleNamespace(lease=_passed)  # type: ignore[assignment]
RANK.context = _passed  # type: ignore[method-assign]
NAMED = {
    "buffer": lambda v: RANK.buffer(v), "peers": lambda v: RANK.peers(v), "peer_view": lambda v: RANK.peer_view(v, 0),
    "group": lambda v: RANK.group(v), "barrier_of": lambda v: RANK.barrier_of(v), "kernel": lambda v: RANK.kernel(v),
    "read": lambda v: RANK.read(v), "write": lambda v: RANK.write(v, np.zeros(4, np.float32)),
    "collectives": lambda v: RANK.collectives(v), "exchange": lambda v: RANK.exchange(v, 1),
    "run": lambda v: RANK.run(v), "run vars key": lambda v: RANK.run("step", {v: 1}),
    "lease state": lambda v: RANK.lease(1, v),
}
NUMBERS = {
    "barrier timeout_s": lambda v: RANK.barrier("world", v), "barrier stream": lambda v: RANK.barrier("world", 1, v),
    "run stream": lambda v: RANK.run("step", None, v), "run vars value": lambda v: RANK.run("step", {"n": v}),
    "lease pages": lambda v: RANK.lease(v),
    "load_weights staging_nbytes": lambda v: RANK.load_weights(staging_nbytes=v),
    "load_weights progress": lambda v: RANK.load_weights(progress=v),
    "exchange timeout_s": lambda v: wire.step_wait(v, "exchange('t')"),
    "session page_indices": lambda v: list(_iterable(v, "session.touch")),
    "dtype": lambda v: numpy_dtype(v),
}


def _refused_as_usage(call, value) -> None:
    try:
        call(value)
    except UsageError as exc:
        assert str(exc) and len(str(exc)) < 1000, str(exc)
    except (TypeError, AttributeError, ValueError, KeyError, OverflowError, ZeroDivisionError) as exc:
        raise AssertionError(f"{value!r:.60}: {type(exc).__name__}: {exc}") from None
    except _Passed:
        pass


@pytest.mark.parametrize("what", sorted(NAMED))
@SETTINGS
@given(value=ODD)
def test_a_name_that_is_no_str_is_a_usage_error(what: str, value: object) -> None:
    assume(not (what == "lease state" and value is None))  # None: the manifest's only state
    assume(not (what == "run vars key" and not isinstance(value, Hashable)))  # a dict cannot hold it
    with pytest.raises(UsageError, match=r"is a name, a str, got "):
        NAMED[what](value)


@pytest.mark.parametrize("what", sorted(NUMBERS))
@SETTINGS
@given(value=st.one_of(ODD, st.text(max_size=6)))
def test_an_odd_number_argument_is_a_usage_error_or_taken(what: str, value: object) -> None:
    _refused_as_usage(NUMBERS[what], value)


@pytest.mark.parametrize("value", [True, "5", b"5", float("nan"), 0, -1, -2**70, None, [1], np.array([1.0, 2.0])])
def test_a_timeout_that_is_not_seconds_is_refused(value: object) -> None:
    with pytest.raises(UsageError, match=r"timeout_s must be a number of seconds > 0"):
        wire.step_wait(value, "exchange('t')")


@pytest.mark.parametrize("value", [1, 0.5, np.float32(2), np.int64(3), math.inf,
                                   pytest.param(10**400, id="10**400")])
def test_a_timeout_in_seconds_is_taken(value: object) -> None:
    assert 0 < wire.step_wait(value, "exchange('t')") <= wire.LONGEST_WAIT_S


def test_a_str_subclass_and_numpy_str_are_names() -> None:
    class Name(str):
        pass

    assert RANK.buffer(Name("x")).nbytes == 16 and RANK.peers(np.str_("x")).ptrs == (4096, 8192)
    assert RANK.group(Name("world")).members == (0, 1)


@pytest.mark.parametrize("call", [lambda: RANK.lease(True), lambda: RANK.load_weights(staging_nbytes=0),
                                  lambda: RANK.barrier("world", 1, stream=-1), lambda: RANK.run("step", stream="0"),
                                  lambda: _iterable(3, "session.touch")])
def test_bools_zero_staging_negative_streams_and_one_page_index_are_refused(call) -> None:
    with pytest.raises(UsageError):
        call()


@pytest.mark.parametrize("call", [lambda: RANK.barrier("world", 1, stream=np.True_),
                                  lambda: RANK.load_weights(staging_nbytes=np.True_),
                                  lambda: RANK.run("step", {"n": np.True_}),
                                  lambda: RANK.peer_view("x", np.True_),
                                  lambda: host_count("allreduce", np.True_),
                                  lambda: RANK.barrier("world", np.True_),
                                  lambda: RANK.exchange("t", 1, np.True_)],
                         ids=["stream", "staging_nbytes", "run vars value", "peer_view member", "collective count",
                              "barrier timeout_s", "exchange timeout_s"])
def test_numpy_bools_are_refused_as_bools_are(call) -> None:
    """numpy before 2.3 still gives its bool an __index__ (deprecated): operator.index took np.True_ for 1 there."""
    with pytest.raises(UsageError):
        call()


@pytest.mark.parametrize("member, shown", [(1.0, "float 1.0"), (True, "bool True"), ("1", "str '1'"),
                                           (np.array(1.5), r"ndarray array\(1.5\)")])
def test_a_peer_view_member_that_is_no_int_is_said_so_not_said_out_of_the_group(member, shown) -> None:
    """1.0 and True are no ranks, but rank 1 is in the group: "rank 1.0 is not in group 'world'" was no cause."""
    with pytest.raises(UsageError, match=rf"^peer_view\('x', member\): member \(a global rank\) must be an int, got "
                                         rf"{shown}$"):
        RANK.peer_view("x", member)
    with pytest.raises(UsageError, match=r"^peer_view\('x', 2\): rank 2 is not in group 'world' of that buffer"):
        RANK.peer_view("x", 2)


def test_an_unknown_kernel_is_named_as_the_other_names_are() -> None:
    """The manifest by its name and file, its kernels as names (was a Python list: "declares ['a']")."""
    with pytest.raises(UsageError, match=r"^no kernel 'nope' in manifest 'w' \(<test>\); it declares \(none\)$"):
        RANK.kernel("nope")


@pytest.mark.parametrize("manifest, message", [
    ("", r"tray.init\(manifest=''\): the manifest's name is empty; give a manifest file's path or a built-in's name"),
    (3, r"tray.init\(manifest=...\): a manifest file's path or a built-in's name \(a str or a pathlib.Path\), got "),
])
def test_init_refuses_an_empty_or_odd_manifest_before_looking_for_its_tray(monkeypatch, manifest, message) -> None:
    """`tray.init(manifest=os.environ.get("M", ""))` with M unset is refused, not the launch's manifest taken in its
    place; outside a tray too (the argument is checked first)."""
    import tray

    for name in [k for k in __import__("os").environ if k.startswith("TRAY_")]:
        monkeypatch.delenv(name)
    with pytest.raises(UsageError, match=message):
        tray.init(manifest=manifest)
