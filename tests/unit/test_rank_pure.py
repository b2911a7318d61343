"""The rank's pure pieces: the phase clock (phase on the heartbeat, durations) and the wiring's lookups."""

from __future__ import annotations

import time
import types

import pytest

from tray.backend.base import GroupInfo
from tray.errors import UsageError
from tray.manifest import parse_manifest
from tray.rank.env import RankEnv
from tray.rank.phases import PhaseClock
from tray.rank.wiring import Buffer, PeerTable, Wiring


def test_timed_phase_reaches_the_heartbeat_and_records_its_duration() -> None:
    sink = types.SimpleNamespace(phase="start")
    clock = PhaseClock(sink)
    with clock.timed("allocate"):
        assert sink.phase == "allocate" and clock.current == "allocate"
        time.sleep(0.01)
    assert 0.01 <= clock.timings["allocate"] < 1.0
    with pytest.raises(RuntimeError), clock.timed("offer"):
        raise RuntimeError("boom")
    assert sink.phase == "offer" and "offer" in clock.timings  # the head names the phase that failed


def test_showing_restores_the_phase_before_and_times_nothing() -> None:
    sink = types.SimpleNamespace(phase="start")
    clock = PhaseClock()
    clock.enter("run")  # no sink yet: only the clock knows
    clock.sink = sink
    with pytest.raises(ValueError), clock.showing("park"):
        assert sink.phase == "park"
        raise ValueError
    assert clock.current == "run" and sink.phase == "run" and clock.timings == {}


def _wiring() -> Wiring:
    doc = {
        "format": 1,
        "name": "w",
        "groups": [{"name": "pairs", "size": 2}],
        "buffers": [
            {"name": "x", "dtype": "f32", "shape": [4], "export": True},
            {"name": "y", "dtype": "u8", "shape": [3]},
        ],
    }
    resolved = parse_manifest(doc, "<test>", ".").resolve(4)
    env = RankEnv(rank=1, world_size=4, local_rank=1, device=1, endpoint="", job_dir="", token="t",
                  manifest="", backend="host", vars=(), t_spawn=None)
    world = GroupInfo("world", (0, 1, 2, 3), 1)
    table = PeerTable("x", world, (16, 32, 48, 64), 4096)
    ptr = types.SimpleNamespace
    return Wiring(env=env, phases=PhaseClock(), client=None, manifest=resolved.manifest, resolved=resolved,
                  backend=None, fd_server=None, groups={"world": world, "pairs": GroupInfo("pairs", (0, 1), 1)},
                  buffers={"x": ptr(ptr=32), "y": ptr(ptr=96), "tray:barrier:world": ptr(ptr=128)},
                  ptr_tables={}, peer_tables={"x": table, "tray:barrier:world": table}, barriers={},
                  collectives={})


def test_the_builtin_default_manifest_is_named_with_how_to_give_one() -> None:
    from tray.manifest import builtin_manifest

    resolved = builtin_manifest().resolve(2)
    env = RankEnv(rank=0, world_size=2, local_rank=0, device=0, endpoint="", job_dir="", token="t",
                  manifest="", backend="host", vars=(), t_spawn=None)
    w = Wiring(env=env, phases=PhaseClock(), client=None, manifest=resolved.manifest, resolved=resolved,
               backend=None, fd_server=None, groups={"world": GroupInfo("world", (0, 1), 0)}, buffers={},
               ptr_tables={}, peer_tables={}, barriers={}, collectives={})  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"no buffer 'inp' in the built-in default manifest \(no --manifest given, "
                                         r"no tray.init\(manifest=...\); tray launch --manifest FILE.json gives the "
                                         r"ranks yours\); it declares \(none\)"):
        w.buffer("inp")
    with pytest.raises(UsageError, match=r"no buffer 'inp' in the built-in default manifest \(no --manifest given"):
        w.peers("inp")


def test_wiring_lookups_name_what_exists() -> None:
    w = _wiring()
    assert w.rank == 1 and w.world_size == 4
    assert w.buffer("x") == Buffer("x", "f32", (4,), 16, 32, True)
    assert w.peers("x").ptrs == (16, 32, 48, 64) and w.group("pairs").members == (0, 1)
    with pytest.raises(UsageError, match=r"no buffer 'z' in manifest 'w' \(<test>\); it declares x, y$"):
        w.buffer("z")
    with pytest.raises(UsageError, match=r"no buffer 'xx' .*; it declares x, y; did you mean 'x'\?"):
        w.buffer("xx")
    with pytest.raises(UsageError, match=r"no peer table for 'y' \(buffer 'y' is not exported: set \"export\": true on "
                                         r"it in manifest 'w' \(<test>\)\); exported buffers with a group containing "
                                         r"rank 1: x$"):
        w.peers("y")
    with pytest.raises(UsageError, match=r"no buffer 'xx' in manifest 'w' \(<test>\); it declares x, y; did you mean "
                                         r"'x'\?"):
        w.peers("xx")  # not a buffer at all: said as buffer() says it, not as a buffer to export
    with pytest.raises(UsageError, match="no peer table for 'tray:barrier:world'"):
        w.peers("tray:barrier:world")  # the tray's own buffers stay private
    with pytest.raises(UsageError, match=r"no group 'pair' in manifest 'w' \(<test>\); its groups: .*pairs.*; "
                                         r"did you mean 'pairs'\?"):
        w.barrier("pair")
    with pytest.raises(UsageError, match=r"no group 'tp' in manifest 'w'"):
        w.barrier("tp")


def test_a_missing_peer_table_or_group_says_why_in_the_manifest_s_terms() -> None:
    """An exported buffer whose group leaves this rank out has no table here: said so, not "set export"; names are
    listed as names, not as a Python list."""
    doc = {"format": 1, "name": "w", "groups": [{"name": "pair", "ranks": [[0, 1]]}],
           "buffers": [{"name": "pb", "dtype": "f32", "shape": [4], "export": True, "group": "pair"}]}
    resolved = parse_manifest(doc, "<test>", ".").resolve(3)
    env = RankEnv(rank=2, world_size=3, local_rank=2, device=2, endpoint="", job_dir="", token="t",
                  manifest="", backend="host", vars=(), t_spawn=None)
    w = Wiring(env=env, phases=PhaseClock(), client=None, manifest=resolved.manifest, resolved=resolved,
               backend=None, fd_server=None, groups={"world": GroupInfo("world", (0, 1, 2), 2)}, buffers={},
               ptr_tables={}, peer_tables={}, barriers={}, collectives={})  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"no peer table for 'pb' \(buffer 'pb' is exported over group 'pair', whose "
                                         r"instances \[\[0, 1\]\] leave out rank 2\); exported buffers with a group "
                                         r"containing rank 2: \(none\)$"):
        w.peers("pb")
    with pytest.raises(UsageError, match=r"rank 2 is no member of group 'pair' \(its instances: \[\[0, 1\]\]\); its "
                                         r"groups: world$"):
        w.group("pair")


class _SlowClose:
    def __init__(self, seconds: float, fail: bool = False) -> None:
        self.seconds, self.fail, self.closed_at = seconds, fail, None

    def close(self) -> None:
        time.sleep(self.seconds)
        self.closed_at = time.monotonic()
        if self.fail:
            raise RuntimeError("destroy failed")


def test_collectives_close_together_and_the_first_failure_comes_after_all() -> None:
    from tray.rank.wiring import LazyCollectives

    comms = {f"g{i}": _SlowClose(0.3, fail=(i == 1)) for i in range(4)}
    lazy = LazyCollectives(joiner=None, pending=(), phases=PhaseClock(), ready=comms)  # type: ignore[arg-type]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="destroy failed"):
        lazy.close()
    assert time.monotonic() - t0 < 0.9  # together: one destroy's time, not four
    assert all(c.closed_at is not None for c in comms.values())  # every one closed before the failure is raised
    lazy.close()  # twice is harmless


def test_release_runs_every_step_when_one_fails_and_raises_the_first_failure() -> None:
    """A failed collectives close (a failed NCCL destroy) must not leave the barriers, the fd server, the backend's
    memory or the head's socket behind."""
    from tray.rank.wiring import _release

    closed: list[str] = []

    def closer(name: str, fail: bool = False) -> types.SimpleNamespace:
        def close() -> None:
            closed.append(name)
            if fail:
                raise RuntimeError(f"{name} failed")
        return types.SimpleNamespace(close=close)

    backend = types.SimpleNamespace(close_graphs=lambda: closed.append("graphs"), close=closer("backend").close)
    timings: dict[str, float] = {}
    with pytest.raises(RuntimeError, match="collectives failed"):
        _release(closer("collectives", fail=True), {"world": closer("barrier", fail=True)},  # type: ignore[arg-type]
                 {"world": closer("ptr_table")}, closer("fd_server"), backend, closer("client"),  # type: ignore[arg-type]
                 timings)
    assert closed == ["graphs", "collectives", "barrier", "ptr_table", "fd_server", "backend", "client"]
    assert set(timings) == {f"close.{step}" for step in
                            ("graphs", "collectives", "barriers", "ptr_tables", "fd_server", "backend", "client")}


def test_a_dtype_tray_does_not_know_is_named_with_the_names_it_takes() -> None:
    from tray.backend.base import numpy_dtype

    assert numpy_dtype("f32") == "float32" and numpy_dtype("bf16").itemsize == 2
    with pytest.raises(UsageError, match=r"dtype 'float32' is not one tray knows \('f32' is tray's name for it\); "
                                         r"it takes bf16, u8, .*f32, f64"):
        numpy_dtype("float32")
    with pytest.raises(UsageError, match="dtype 'fp8' is not one tray knows; it takes bf16"):
        numpy_dtype("fp8")
    import ml_dtypes
    import numpy as np

    # a numpy type, a dtype or ml_dtypes' bfloat16 given for the name: the hint too (it had none)
    for given, meant in ((np.float32, "f32"), (np.dtype("int16"), "i16"), (ml_dtypes.bfloat16, "bf16")):
        with pytest.raises(UsageError, match=rf"is not one tray knows \('{meant}' is tray's name for it\)"):
            numpy_dtype(given)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"dtype \[1\] is not one tray knows; it takes"):
        numpy_dtype([1])  # type: ignore[arg-type]


def test_the_code_a_hook_runs_first_is_found_through_what_wraps_it_and_never_raises():
    """An uncaught exception is told from one the program logs by the stack's first frame: the code of the hook the
    interpreter calls. A hook that wraps tray's in a way not seen through passed for a log (no report), and a dead
    weakref.proxy as the hook raised inside tray's own hook (neither report nor the previous hook's print)."""
    import functools
    import weakref

    from tray.rank import _code_of

    def hook(*exc):
        pass

    class Callable:
        def __call__(self, *exc):
            pass

    class Hook:
        def __init__(self, *exc):
            pass

    class Gone:
        pass

    gone = Gone()
    proxy = weakref.proxy(gone)
    del gone
    wrapped = functools.wraps(hook)(lambda *exc: hook(*exc))
    found = {name: _code_of(h) for name, h in [
        ("function", hook), ("partial", functools.partial(hook, 1)), ("callable", Callable()),
        ("method", Callable().__call__), ("class", Hook), ("staticmethod", staticmethod(hook)),
        ("lru_cache", functools.lru_cache(hook)), ("wraps", wrapped), ("builtin", print),
        ("partial of a builtin", functools.partial(print)), ("dead proxy", proxy)]}
    assert found == {"function": hook.__code__, "partial": hook.__code__, "callable": Callable.__call__.__code__,
                     "method": Callable.__call__.__code__, "class": Hook.__init__.__code__,
                     "staticmethod": hook.__code__, "lru_cache": hook.__code__, "wraps": wrapped.__code__,
                     "builtin": None, "partial of a builtin": None, "dead proxy": None}
