"""Buffers as tensors on the host backend: numpy and torch (CPU) views of own and peer buffers, written by
one rank and read by the others byte for byte; the lifetime of views past rank.close()."""

from __future__ import annotations

import json

import pytest

VIEWS_MANIFEST = {
    "format": 1,
    "name": "views",
    "description": "typed buffers for tensor views",
    "vars": {"rows": 3, "cols": 5},
    "groups": [{"name": "world", "ranks": "all"}],
    "buffers": [
        {"name": "x", "dtype": "f32", "shape": ["rows", "cols"], "export": True},
        {"name": "h", "dtype": "bf16", "shape": ["rows", "cols"], "export": True},
        {"name": "c", "dtype": "u16", "shape": ["rows"], "export": True},
        {"name": "private", "dtype": "i32", "shape": [4], "export": False},
    ],
    "programs": [{"name": "sync", "graph": True, "ops": [{"op": "barrier", "group": "world"}]}],
}

# Every rank fills its own buffers through writable views with a pattern of its rank, then reads every
# peer's through peer views and checks the bytes against what that peer wrote.
_PATTERN = """
import ml_dtypes
def pattern(r, rows=3, cols=5):
    x = (np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + 0.25) * (r + 1)
    h = x.astype(ml_dtypes.bfloat16)
    c = (np.arange(rows, dtype=np.uint16) + 100 * r)
    return x, h, c
"""


@pytest.fixture
def manifest(tmp_path):
    path = tmp_path / "views.json"
    path.write_text(json.dumps(VIEWS_MANIFEST))
    return str(path)


def test_numpy_views_of_own_and_peer_buffers(tray_env, manifest):
    body = _PATTERN + """
with tray.init() as rank:
    me, n = rank.rank, rank.world_size
    x, h, c = pattern(me)
    own = np.from_dlpack(rank.buffer("x"))                  # DLPack, versioned: writable
    assert own.dtype == np.float32 and own.shape == (3, 5), (own.dtype, own.shape)
    own[...] = x
    try:                                                    # numpy knows no DLPack bf16: a clean refusal
        np.from_dlpack(rank.buffer("h"))
    except (RuntimeError, BufferError, TypeError) as exc:
        assert "dtype" in str(exc), exc
    hv = np.asarray(rank.buffer("h"))                       # bf16 through __array__ (ml_dtypes)
    assert hv.dtype == ml_dtypes.bfloat16 and hv.shape == (3, 5), hv.dtype
    hv[...] = h
    cv = np.asarray(rank.buffer("c"))                       # __array_interface__
    assert cv.dtype == np.uint16 and cv.shape == (3,)
    cv[...] = c
    assert rank.buffer("x").__dlpack_device__() == (1, 0)
    rank.barrier()
    for p in range(n):
        px, ph, pc = pattern(p)
        vx = np.from_dlpack(rank.peer_view("x", p))
        vh = np.asarray(rank.peer_view("h", p))             # bf16: __array__ (no typestr)
        vc = np.asarray(rank.peer_view("c", p))
        assert vx.tobytes() == px.tobytes(), (p, vx)
        assert vh.dtype == ml_dtypes.bfloat16 and vh.tobytes() == ph.tobytes(), p
        assert vc.tobytes() == pc.tobytes(), p
        assert rank.peer_view("x", p).__dlpack_device__() == (1, 0)
    rank.barrier()                                          # every rank has read every peer
    own[0, 0] = -1.0                                        # zero-copy: view and buffer are one memory
    assert rank.read("x")[0, 0] == -1.0
    rank.barrier()
    assert rank._leases.live() > 0
    print("numpy views ok", n)
"""
    run = tray_env.launch(3, body, "--manifest", manifest)
    assert run.returncode == 0, run.output
    assert run.stdout.count("numpy views ok 3") == 3


def test_torch_views_of_own_and_peer_buffers(tray_env, manifest):
    pytest.importorskip("torch", reason="torch (CPU) is installed by `make test`; this run has none")
    body = _PATTERN + """
import torch
with tray.init() as rank:
    me, n = rank.rank, rank.world_size
    x, h, c = pattern(me)
    t = torch.from_dlpack(rank.buffer("x"))
    assert t.dtype == torch.float32 and tuple(t.shape) == (3, 5) and t.device.type == "cpu"
    t.copy_(torch.from_numpy(x))
    th = torch.from_dlpack(rank.buffer("h"))
    assert th.dtype == torch.bfloat16, th.dtype
    th.copy_(torch.from_numpy(x).to(torch.bfloat16))
    tc = torch.from_dlpack(rank.buffer("c"))
    assert tc.dtype == torch.uint16, tc.dtype
    tc.copy_(torch.from_numpy(c.astype(np.int32)).to(torch.uint16))
    assert t.data_ptr() == rank.buffer("x").ptr
    rank.barrier()
    for p in range(n):
        px, ph, pc = pattern(p)
        vx = torch.from_dlpack(rank.peer_view("x", p))
        vh = torch.from_dlpack(rank.peer_view("h", p))
        vc = torch.from_dlpack(rank.peer_view("c", p))
        assert vx.numpy().tobytes() == px.tobytes(), p
        assert vh.view(torch.int16).numpy().tobytes() == ph.tobytes(), p
        assert vc.view(torch.int16).numpy().tobytes() == pc.tobytes(), p
        assert vx.data_ptr() == rank.peers("x").ptrs[p]
    rank.barrier()
    # a torch op on a peer's memory lands in the peer's buffer: every rank adds 1 to its right neighbour's x
    right = (me + 1) % n
    torch.from_dlpack(rank.peer_view("x", right)).add_(1)
    rank.barrier()
    assert rank.read("x").tobytes() == (x + 1).tobytes(), rank.read("x")
    # an error raised while a temporary view dies reaches the caller as raised (torch CPU has no u16 add: a
    # NotImplementedError; in torch 2.4 a RuntimeError)
    try:
        torch.from_dlpack(rank.peer_view("c", right)).add_(1)
    except (NotImplementedError, RuntimeError) as exc:
        assert "UInt16" in str(exc), exc
    rank.barrier()
    # write() takes numpy data; a tensor is pointed at its view (numpy has no bf16 tensor conversion)
    try:
        rank.write("h", torch.zeros(3, 5, dtype=torch.bfloat16))
    except tray.UsageError as exc:
        assert "copy a tensor into the buffer's view instead: torch.from_dlpack(rank.buffer('h'))" in str(exc), exc
    else:
        raise AssertionError("write() took a tensor")
    print("torch views ok", n)
"""
    run = tray_env.launch(2, body, "--manifest", manifest)
    assert run.returncode == 0, run.output
    assert run.stdout.count("torch views ok 2") == 2


def test_a_temporary_tensor_given_to_a_collective_is_read_whole(tray_env, manifest):
    """`c.allreduce(torch.full(...), y, ...)`: the temporary was freed before the collective read it (y full of
    garbage; on 4 ranks a SIGSEGV at the next allocation), as was `big[::2].contiguous()`, which the message for a
    strided tensor advises."""
    pytest.importorskip("torch", reason="torch (CPU) is installed by `make test`; this run has none")
    body = """
import torch
with tray.init() as rank:
    c = rank.collectives("world")
    for i in range(20):
        y = torch.zeros(4096)
        c.allreduce(torch.full((4096,), float(i + rank.rank)), y, 4096, "f32")
        assert (y == 2 * i + 1).all(), (i, y[:4])
        big = torch.arange(8192, dtype=torch.float32)
        c.allreduce(big[::2].contiguous(), y, 4096, "f32")
        assert (y == 2 * big[::2]).all(), (i, y[:4])
        junk = [torch.ones(4096) for _ in range(4)]   # what would reuse a freed temporary
    print("temporaries ok", flush=True)
"""
    run = tray_env.launch(2, body, "--manifest", manifest, "--var", "rows=64", "--var", "cols=64")
    assert run.returncode == 0, run.output
    assert run.stdout.count("temporaries ok") == 2, run.output


def test_views_outlive_close_and_bad_requests_are_named(tray_env, manifest):
    body = """
from tray import UsageError
rank = tray.init()
me, n = rank.rank, rank.world_size
np.from_dlpack(rank.buffer("x"))[...] = me + 1
rank.barrier()
peer = (me + 1) % n
kept = np.from_dlpack(rank.peer_view("x", peer))       # a live view of a peer mapping
mine = np.asarray(rank.buffer("c"))                     # and one of an own buffer
for bad, expect in ((lambda: rank.peer_view("x", n), "not in group"),
                    (lambda: rank.peer_view("private", 0), "no peer table"),
                    (lambda: rank.buffer("nope"), "no buffer")):
    try:
        bad()
    except UsageError as exc:
        assert expect in str(exc), exc
    else:
        raise AssertionError(expect)
try:
    rank.buffer("x").__dlpack__(copy=True)
except BufferError as exc:
    assert "zero-copy" in str(exc)
else:
    raise AssertionError("copy=True accepted")
rank.barrier()
# stream= is accepted everywhere on host (there are no streams: the work runs now, in program order)
rank.barrier(stream=0)
rank.run("sync", stream=0)
c = rank.buffer("c")
mine[...] = me + 1
rank.collectives("world").allreduce(c.ptr, c.ptr, 3, "u16", stream=0)
assert (mine == n * (n + 1) // 2).all(), mine
rank.barrier()
unused = rank.buffer("h")                               # no view of h handed out memory: released at close
rank.close()                                            # returns: the leased memory stays mapped
try:
    np.asarray(unused)
except UsageError as exc:
    assert "released" in str(exc), exc
else:
    raise AssertionError("a view of released memory")
assert (kept == peer + 1).all(), kept                   # still readable after close
mine[...] = 7
assert rank._leases.live() == 2, rank._leases.live()
del kept, mine
import gc; gc.collect()
assert rank._leases.live() == 0
try:
    rank.buffer("x")
except UsageError as exc:
    assert "after close" in str(exc)
else:
    raise AssertionError("buffer() after close")
print("lifetime ok")
"""
    run = tray_env.launch(2, body, "--manifest", manifest)
    assert run.returncode == 0, run.output
    assert run.stdout.count("lifetime ok") == 2


def test_peer_view_takes_a_rank_held_by_a_numpy_integer_and_refuses_a_bool(tray_env, manifest):
    """Ranks often come from numpy (np.arange(n), a permutation) or torch: `peer_view` takes any integer that holds
    one (operator.index), not only a Python int; True is no rank (it gave rank 1's view)."""
    body = """
with tray.init() as rank:
    me, n = rank.rank, rank.world_size
    np.asarray(rank.buffer("c"))[...] = 100 + me
    rank.barrier()
    for p in np.arange(n):
        v = rank.peer_view("c", p)
        assert v.member == int(p) and type(v.member) is int, v
        assert np.asarray(v)[0] == 100 + p, (p, np.asarray(v))
    try:
        rank.peer_view("c", True)
    except tray.UsageError as exc:
        assert "member (a global rank) must be an int, got bool True" in str(exc), exc
    else:
        raise AssertionError("peer_view(name, True) was taken for a rank")
    for bad in (np.arange(n), np.array(1.5)):  # they have __index__, but hold no rank: a UsageError as any other
        try:
            rank.peer_view("c", bad)
        except tray.UsageError as exc:
            assert "member (a global rank) must be an int, got ndarray" in str(exc), exc
        else:
            raise AssertionError(f"peer_view(name, {bad!r}) was taken for a rank")
    rank.barrier()
    print("numpy ranks ok", me)
"""
    run = tray_env.launch(2, body, "--manifest", manifest)
    assert run.returncode == 0, run.output
    assert run.stdout.count("numpy ranks ok") == 2, run.output
