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


def test_vars_given_to_run_concern_its_program_alone_and_a_resized_buffer_is_said_as_such(tray_env):
    """run("varcnt", vars={"k": 32}) failed with another program's op (coll's count of k * 8 over a buffer of 128),
    though that program was not run: the whole manifest was resolved with the vars; and vars={"n": 4} was said as the
    program's copy overrunning buffer 'a' (16 B) rather than as 'a' resized. Now only the program run is resolved, after
    the buffers and groups are compared with those made at launch."""
    import json

    manifest = tray_env.tmp / "two.json"
    manifest.write_text(json.dumps({
        "format": 1, "name": "two", "vars": {"n": 128, "k": 16},
        "buffers": [{"name": "a", "dtype": "f32", "shape": ["n"]}, {"name": "b", "dtype": "f32", "shape": [128]},
                    {"name": "c", "dtype": "f32", "shape": [128]}],
        "programs": [
            {"name": "varcnt", "ops": [{"op": "copy", "src": "a", "dst": "c", "bytes": "k * 4"}]},
            {"name": "coll", "ops": [{"op": "nccl", "collective": "allreduce", "group": "world", "send": "b",
                                      "recv": "c", "count": "k * 8", "dtype": "f32"}]}]}))
    body = """
with tray.init() as rank:
    rank.write("a", np.arange(128, dtype=np.float32))
    rank.run("varcnt", vars={"k": 32}); rank.synchronize()   # coll's count would be 256 of 128: not run, not judged
    assert np.array_equal(rank.read("c")[:32], np.arange(32, dtype=np.float32))
    for name, v in (("varcnt", {"n": 4}), ("nope", {"k": 1})):
        try:
            rank.run(name, vars=v)
        except tray.UsageError as exc:
            print("refused:", str(exc).splitlines()[0], flush=True)
    print("vars ok", flush=True)
"""
    run = tray_env.launch(2, body, "--manifest", str(manifest))
    assert run.returncode == 0, run.output
    refused = [line for line in run.stdout.splitlines() if line.startswith("[rank 0] refused: ")]
    assert len(refused) == 2, run.stdout
    assert "program 'varcnt' with n=4: buffer 'a' would need 16 B but was allocated with 512 B" in refused[0], refused
    assert "'nope'" in refused[1] and "varcnt" in refused[1] and "coll" in refused[1], refused
    assert run.stdout.count("vars ok") == 2


def test_a_rank_that_builds_many_plans_is_told_once_that_each_is_kept(tray_env):
    """Each distinct vars given to run() keeps its plan for the tray's life: a var per request (a token count) grew
    the rank by ~3.7 KiB a plan on the host (a graph each on cuda) without a word. At 256 plans it is said, once."""
    import json

    manifest = tray_env.tmp / "grow.json"
    manifest.write_text(json.dumps({
        "format": 1, "name": "grow", "vars": {"k": 1},
        "buffers": [{"name": "a", "dtype": "f32", "shape": [512]}, {"name": "c", "dtype": "f32", "shape": [512]}],
        "programs": [{"name": "cp", "ops": [{"op": "copy", "src": "a", "dst": "c", "bytes": "k * 4"}]}]}))
    body = """
with tray.init() as rank:
    for k in range(1, 301):
        rank.run("cp", vars={"k": k})
    print("ran", flush=True)
"""
    run = tray_env.launch(1, body, "--manifest", str(manifest))
    assert run.returncode == 0, run.output
    assert run.stderr.count("rank.run() has built 256 plans (this one: program 'cp' with {'k': 256})") == 1, run.stderr
    assert "give run() sizes from a few buckets" in run.stderr
