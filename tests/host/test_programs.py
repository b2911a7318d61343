"""Manifest programs run by the executor, in lockstep, checked against numpy on every rank."""

from __future__ import annotations

from conftest import MANIFESTS

SMOKE = str(MANIFESTS / "program_smoke.json")

BODY = """
import ml_dtypes
from tray.backend.host.twins import peer_fill_words
BACKEND_SYNC = True
with tray.init() as rank:
    me, n = rank.rank, rank.world_size
    rng = np.random.default_rng(5)
    xs = rng.integers(-100, 100, (n, 256)).astype(np.float32)
    a = rng.standard_normal((8, 32)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((16, 32)).astype(ml_dtypes.bfloat16)
    rank.write("x", xs[me]); rank.write("a", a); rank.write("b", b)
    for _ in range(3):                      # resolved once, replayed
        rank.run("step")
        rank.synchronize()
    words = rank.buffer("fill").shape[0] // n
    got = rank.read("fill").reshape(n, words)
    for w in range(n):
        assert (got[w] == peer_fill_words(11, w, me, words)).all(), w
    assert np.array_equal(rank.read("z"), xs.sum(0))
    ref = a.astype(np.float32) @ b.astype(np.float32).T
    err = np.abs(rank.read("c").astype(np.float32) - ref).max() / np.abs(ref).max()
    assert err < 1e-2, err
    rank.write("z", np.zeros(256, np.float32))
    rank.run("captured"); rank.synchronize()
    assert np.array_equal(rank.read("z"), xs.sum(0))
    try:
        rank.run("step", {"words": 8})
    except tray.UsageError as exc:
        assert "set size-changing vars at launch" in str(exc)
    else:
        raise AssertionError("a size-changing var was accepted at run time")
    try:
        rank.run("step", [("words", 8)])
    except tray.UsageError as exc:
        assert "vars is a dict of var name -> int, got a list" in str(exc), exc
    else:
        raise AssertionError("vars as a list was accepted")
    print("programs ok")
"""


def test_program_ops_in_lockstep(tray_env):
    run = tray_env.launch(4, BODY, "--manifest", SMOKE)
    assert run.returncode == 0, run.output
    assert run.stdout.count("programs ok") == 4


def test_a_var_that_changes_a_group_is_refused_at_run_like_a_buffers_size(tray_env):
    """Groups are formed at launch: run(vars=...) that would change one (its size var here) is a UsageError naming the
    group and the var. It was taken: the op was checked against the group of the new size (1 member, so 128 elements
    fit `recv`) while it ran over the group as launched (2 members: 256 elements into a buffer of 128; NCCL on cuda
    would have written past it)."""
    import json

    manifest = tray_env.tmp / "team.json"
    manifest.write_text(json.dumps({
        "format": 1, "name": "team", "vars": {"g": 2, "c": 32},
        "groups": [{"name": "team", "size": "g"}],
        "buffers": [{"name": "send", "dtype": "f32", "shape": [128]}, {"name": "recv", "dtype": "f32", "shape": [128]}],
        "programs": [{"name": "gather", "ops": [{"op": "nccl", "collective": "allgather", "group": "team",
                                                  "send": "send", "recv": "recv", "count": "c", "dtype": "f32"}]}]}))
    body = """
with tray.init() as rank:
    rank.run("gather", vars={"c": 64})          # the group as launched: fine
    try:
        rank.run("gather", vars={"g": 1, "c": 128})
    except tray.UsageError as exc:
        assert "group 'team'" in str(exc) and "g=1" in str(exc) and "tray launch --var" in str(exc), exc
    else:
        raise AssertionError("a var that changes a group was taken at run time")
    print("groups ok")
"""
    run = tray_env.launch(2, body, "--manifest", str(manifest))
    assert run.returncode == 0, run.output
    assert run.stdout.count("groups ok") == 2
