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
    print("programs ok")
"""


def test_program_ops_in_lockstep(tray_env):
    run = tray_env.launch(4, BODY, "--manifest", SMOKE)
    assert run.returncode == 0, run.output
    assert run.stdout.count("programs ok") == 4
