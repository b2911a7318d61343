"""tray inside torch programs on GPUs: zero-copy views of own and peer buffers, a tray barrier and collective
on torch's stream inside a torch.cuda.graph capture, init_process_group("nccl") next to tray.init()."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, gpu_ranks

pytestmark = pytest.mark.gpu

TORCH_MANIFEST = {
    "format": 1,
    "name": "torch_views",
    "description": "typed buffers for torch views, a barrier program",
    "vars": {"rows": 64, "cols": 1024},
    "groups": [{"name": "world", "ranks": "all"}],
    "buffers": [
        {"name": "x", "dtype": "bf16", "shape": ["rows", "cols"], "export": True},
        {"name": "y", "dtype": "f32", "shape": ["rows", "cols"], "export": True},
        {"name": "slots", "dtype": "f32", "shape": ["world_size"], "export": True},
        {"name": "s", "dtype": "f32", "shape": [8], "export": True},
    ],
    "programs": [
        {"name": "sync", "graph": False, "ops": [{"op": "barrier", "group": "world"}]},
        {"name": "sync_graph", "graph": True, "ops": [{"op": "barrier", "group": "world"}]},
    ],
}

# Every rank program is bounded: past RANK_BOUND_S (a passing program takes ~8 s on 2x H200) faulthandler
# prints every thread's Python stack to the rank's stderr and exits, so the launcher ends the tray and the
# failure message shows where each rank waited (a rank the launcher stops prints its stacks too). The
# launch itself is bounded below pytest's timeout.
RANK_BOUND_S = 20
LAUNCH_BOUND_S = 45
TAIL_LINES = 60

_HEAD = f"""
import faulthandler, signal
faulthandler.dump_traceback_later({RANK_BOUND_S}, exit=True)
faulthandler.register(signal.SIGTERM, chain=True)      # stopped by the launcher: where it was, then exit
T0 = time.monotonic()


def say(what):
    print(f"phase {{what}} at {{time.monotonic() - T0:.1f}} s", file=sys.stderr, flush=True)


import torch
device = torch.device("cuda", int(os.environ["TRAY_DEVICE"]))
torch.cuda.set_device(device)
"""


def ngpus() -> int:
    return gpu_ranks()


@pytest.fixture
def manifest(tmp_path):
    path = tmp_path / "torch_views.json"
    path.write_text(json.dumps(TORCH_MANIFEST))
    return str(path)


@pytest.fixture(autouse=True)
def nccl_warnings(monkeypatch):
    """NCCL's own warnings reach the ranks' stderr (and so the failure message)."""
    monkeypatch.setenv("NCCL_DEBUG", "WARN")


def _text(out) -> str:
    if out is None:
        return ""
    return out.decode(errors="replace") if isinstance(out, bytes) else out


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _stderr_tails(stderr: str) -> str:
    """The launcher's last lines (who failed, how), then the last TAIL_LINES lines the ranks wrote."""
    lines = stderr.splitlines()
    ranks = [line for line in lines if line.startswith("[rank ")]
    head = [line for line in lines if not line.startswith("[rank ")]
    return ("--- launcher stderr tail\n" + "\n".join(head[-15:]) + "\n--- ranks' stderr tail\n"
            + "\n".join(ranks[-TAIL_LINES:]))


def _rank_logs(log_dir: Path) -> str:
    """Every rank's log (--log-dir) tail, for a launch that did not end in time."""
    parts = []
    for path in sorted(log_dir.glob("rank-*.log")):
        parts.append(f"--- {path.name}\n{_tail(path.read_text(errors='replace'), TAIL_LINES // 2)}")
    return "\n".join(parts) or "(no rank logs)"


def _launch(tray_env, body: str, *args: str, n: int | None = None):
    """Run `body` on n GPUs under `tray launch`; on failure the message holds the last TAIL_LINES lines of
    the ranks' stderr (faulthandler's stacks when a rank hung)."""
    n = n or ngpus()
    if n < 2:
        pytest.skip(f"needs 2 GPUs, {n} visible")
    log_dir = tray_env.tmp / "rank-logs"
    try:
        run = tray_env.launch(n, _HEAD + body, "--log-dir", str(log_dir), *args, backend="cuda",
                              timeout_s=LAUNCH_BOUND_S)
    except subprocess.TimeoutExpired as exc:
        stderr = _text(exc.stderr)
        run = None
    if run is None:
        pytest.fail(f"tray launch did not end within {LAUNCH_BOUND_S} s\n{_stderr_tails(stderr)}\n"
                    f"--- rank logs\n{_rank_logs(log_dir)}", pytrace=False)
    if run.returncode != 0:
        pytest.fail(f"tray launch exited {run.returncode} after {run.seconds:.1f} s\n"
                    f"--- stdout tail\n{_tail(run.stdout, 10)}\n{_stderr_tails(run.stderr)}", pytrace=False)
    return n, run


def test_torch_fills_own_buffer_and_reads_every_peer(tray_env, manifest):
    body = """
with tray.init() as rank:
    me, n = rank.rank, rank.world_size
    assert rank.buffer("x").__dlpack_device__() == (2, device.index)
    x = torch.from_dlpack(rank.buffer("x"))
    assert x.device == device and x.dtype == torch.bfloat16 and tuple(x.shape) == (64, 1024), (x.device, x.dtype)
    assert x.data_ptr() == rank.buffer("x").ptr
    ar = torch.arange(64 * 1024, device=device, dtype=torch.float32).view(64, 1024)
    x.copy_((ar % 251 + me * 1000).to(torch.bfloat16))       # torch ops into tray's memory
    y = torch.as_tensor(rank.buffer("y"), device=device)     # __cuda_array_interface__ v3
    assert y.data_ptr() == rank.buffer("y").ptr and y.dtype == torch.float32
    y.copy_(ar * (me + 1))
    rank.barrier(stream=torch.cuda.current_stream().cuda_stream)   # after torch's writes, on torch's stream
    for p in range(n):
        px = torch.from_dlpack(rank.peer_view("x", p))
        assert px.device == device, px.device                  # a peer view is on THIS GPU
        assert px.data_ptr() == rank.peers("x").ptrs[p]
        want = (ar % 251 + p * 1000).to(torch.bfloat16)
        assert torch.equal(px.view(torch.int16), want.view(torch.int16)), p
        py = torch.from_dlpack(rank.peer_view("y", p))
        assert torch.equal(py, ar * (p + 1)), p
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:                                   # another DLPack consumer, same zero-copy views
        with cupy.cuda.Device(device.index):
            cy = cupy.from_dlpack(rank.peer_view("y", (me + 1) % n))
            assert cy.data.ptr == rank.peers("y").ptrs[(me + 1) % n]
            assert float(cy[3, 5]) == float(ar[3, 5] * ((me + 1) % n + 1))
    # a peer's memory written with a torch op, read back by its owner
    right = (me + 1) % n
    torch.from_dlpack(rank.peer_view("slots", right))[me] = float(me + 7)
    torch.cuda.synchronize()
    rank.barrier()
    left = (me - 1) % n
    assert rank.read("slots")[left] == left + 7, rank.read("slots")
    rank.barrier()
    print("views ok", n)
"""
    n, run = _launch(tray_env, body, "--manifest", manifest)
    assert run.stdout.count(f"views ok {n}") == n


# What a body run on `stream` does, by part; each part alone, then all of them, inside a torch.cuda.graph.
_GRAPH_PARTS = {
    "barrier": """
        slots[me:me + 1].copy_(step)
        rank.barrier(stream=stream)                     # every rank's slot written
        for p in range(n):
            got[p:p + 1].copy_(peers[p][p:p + 1])
""",
    "allreduce": """
        s.copy_(step.expand(8) * (me + 1))
        coll.allreduce(sbuf.ptr, sbuf.ptr, 8, "f32", stream=stream)    # NCCL on torch's stream
""",
    "run": """
        slots[me:me + 1].copy_(step)
        rank.run("sync", stream=stream)                 # a program (one barrier) on the same stream
        for p in range(n):
            got[p:p + 1].copy_(peers[p][p:p + 1])
""",
    "run_graph": """
        slots[me:me + 1].copy_(step)
        rank.run("sync_graph", stream=stream)           # tray's own graph: recorded step by step here
        for p in range(n):
            got[p:p + 1].copy_(peers[p][p:p + 1])
""",
}
_GRAPH_PARTS["all"] = _GRAPH_PARTS["barrier"] + _GRAPH_PARTS["allreduce"] + """
        rank.run("sync", stream=stream)
        rank.run("sync_graph", stream=stream)
"""

_GRAPH_PROGRAM = """
with tray.init() as rank:
    me, n = rank.rank, rank.world_size
    slots = torch.from_dlpack(rank.buffer("slots"))
    s = torch.from_dlpack(rank.buffer("s"))
    step = torch.zeros(1, device=device)
    got = torch.zeros(n, device=device)
    peers = [torch.from_dlpack(rank.peer_view("slots", p)) for p in range(n)]
    coll = rank.collectives("world")
    sbuf = rank.buffer("s")
    checks_got, checks_sum = {checks_got}, {checks_sum}

    def body(stream):
        step.add_(1)
{part}
    say("warm-up")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                       # outside the capture: plans and launches built
        body(side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    rank.synchronize()
    step.zero_()
    rank.barrier()
    say("capture")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body(torch.cuda.current_stream().cuda_stream)
    for replay in range(1, 6):
        say(f"replay {{replay}}")
        graph.replay()
        torch.cuda.synchronize()
        rank.synchronize()                               # raises if a barrier in the graph timed out
        if checks_got:
            assert got.tolist() == [float(replay)] * n, (replay, got.tolist())
        if checks_sum:
            assert s.tolist() == [replay * n * (n + 1) / 2] * 8, (replay, s.tolist())
        rank.barrier()                                   # nobody replays again before every rank has checked
    print("graph ok", n)
    {before_close}
    say("close")
{after_close}
say("closed")
"""

# NCCL destroys a communicator only after every CUDA graph that captured its work is gone: a torch graph
# holding tray collectives is destroyed before rank.close() (the `with` block's end)
_DESTROY_GRAPH = "graph.reset(); del graph"


def _graph_program(part: str, keep_graph_past_close: bool = False) -> str:
    got = part != "allreduce"
    total = part in ("allreduce", "all")
    return _GRAPH_PROGRAM.format(part=_GRAPH_PARTS[part], checks_got=got, checks_sum=total,
                                 before_close="pass" if keep_graph_past_close else _DESTROY_GRAPH,
                                 after_close=_DESTROY_GRAPH if keep_graph_past_close else "")


@pytest.mark.parametrize("part", ["barrier", "allreduce", "run", "run_graph", "all"])
def test_on_torch_stream_inside_a_cuda_graph(tray_env, manifest, part):
    """Warm-up of body(stream) on a torch side stream, a torch.cuda.graph capture of it, 5 replays checked."""
    n, run = _launch(tray_env, _graph_program(part), "--manifest", manifest)
    assert run.stdout.count(f"graph ok {n}") == n, _tail(run.output)
    assert "did not return within" not in run.stderr, _tail(run.stderr)


def test_torch_graph_capture_after_an_early_nccl_join(tray_env, manifest):
    """NCCL joined early (--join-collectives early): the warm-up's first allreduce waits for the join, so the
    torch.cuda.graph capture that follows (global mode) meets no allocation on the join's thread."""
    n, run = _launch(tray_env, _graph_program("allreduce"), "--manifest", manifest, "--join-collectives", "early")
    assert run.stdout.count(f"graph ok {n}") == n, _tail(run.output)
    assert "NCCL: the ranks join their groups on a thread" in run.stderr, _tail(run.stderr)


_CAPTURE_DURING_THE_JOIN = """
import tray.backend.cuda.driver as drv
if {unrelaxed}:                                       # the join's thread left in the default GLOBAL mode
    drv.thread_capture_mode_relaxed = lambda: None
    drv.thread_capture_mode_restore = lambda previous: None
with tray.init() as rank:
    me, n = rank.rank, rank.world_size
    early = rank._wiring.collectives._early
    joining = early is not None and not early.done
    y = torch.zeros(1024, device=device)
    graph = torch.cuda.CUDAGraph()
    say("capture")
    try:
        with torch.cuda.graph(graph):                 # GLOBAL mode, torch's default, begun while NCCL joins
            y.add_(1.0)
            time.sleep(1.5)                           # open long after the join's ~0.4 s
            y.mul_(3.0)
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        captured = "ok" if bool(torch.all(y == 12.0)) else f"wrong {{y[:2].tolist()}}"
    except Exception as exc:
        captured = f"{{type(exc).__name__}}: {{str(exc).splitlines()[0][:160]}}"
    try:
        s = torch.from_dlpack(rank.buffer("s"))
        s.fill_(float(me + 1)); torch.cuda.synchronize()
        rank.collectives("world").allreduce(rank.buffer("s").ptr, rank.buffer("s").ptr, 8, "f32")
        rank.synchronize()
        joined = "ok" if s.tolist() == [n * (n + 1) / 2] * 8 else f"wrong {{s.tolist()}}"
    except Exception as exc:
        joined = f"{{type(exc).__name__}}: {{str(exc).splitlines()[0][:160]}}"
    print(f"joining at capture {{joining}}; capture {{captured}}; collectives {{joined}}", flush=True)
"""


@pytest.mark.parametrize("relaxed", [True, False], ids=["relaxed", "global"])
def test_a_global_torch_capture_while_nccl_joins_early(tray_env, manifest, relaxed):
    """A torch.cuda.graph capture (GLOBAL mode) begun right after tray.init(), while the early join's thread is
    still in ncclCommInitRank. tray relaxes that thread's capture mode, so the capture and the join both succeed.
    With the thread left in GLOBAL mode ("global": the join's unsafe calls are prohibited while the capture is
    open) something must break, or the relaxation would not be needed."""
    body = _CAPTURE_DURING_THE_JOIN.format(unrelaxed=not relaxed)
    proc_n = ngpus()
    if proc_n < 1:
        pytest.skip("needs a GPU")
    log_dir = tray_env.tmp / "rank-logs"
    run = tray_env.launch(proc_n, _HEAD + body, "--manifest", manifest, "--join-collectives", "early",
                          "--log-dir", str(log_dir), backend="cuda", timeout_s=LAUNCH_BOUND_S)
    said = "joining at capture"
    lines = [line[line.index(said):] for line in run.stdout.splitlines() if said in line]  # after "[rank r] "
    print("\n".join(lines))
    assert lines and all(line.startswith("joining at capture True") for line in lines), lines  # the overlap happened
    if relaxed:
        assert run.returncode == 0 and len(lines) == proc_n, _tail(run.output)
        assert all(line.endswith("capture ok; collectives ok") for line in lines), lines
    else:  # why the thread relaxes: in GLOBAL mode the capture failed and so did the join (NCCL 2.28.9, one H200;
        # at 4 ranks sharing one H200, 2 ranks said so and the others waited in NCCL for members that had failed,
        # until the program's bound ended them: a rank that never reports is part of the breakage)
        assert run.returncode != 0 or len(lines) == proc_n, _tail(run.output)
        assert not any(line.endswith("capture ok; collectives ok") for line in lines), lines


def test_torch_graph_kept_past_close_does_not_hang_it(tray_env, manifest, monkeypatch):
    """A graph that captured tray's NCCL work and outlives rank.close(): close waits a bounded time, says
    why, and the program goes on (the communicator is destroyed once the graph is)."""
    monkeypatch.setenv("TRAY_NCCL_CLOSE_TIMEOUT_S", "3")
    n, run = _launch(tray_env, _graph_program("allreduce", keep_graph_past_close=True), "--manifest", manifest)
    assert run.stdout.count(f"graph ok {n}") == n, _tail(run.output)
    assert run.stderr.count("did not return within 3 s") == n, _tail(run.stderr)
    assert run.stderr.count("phase closed") == n, _tail(run.stderr)


def test_init_process_group_nccl_next_to_tray_init(tray_env):
    body = """
import torch.distributed as dist
dist.init_process_group("nccl", device_id=device)    # env:// from tray launch, as under torchrun
with tray.init() as rank:
    t = torch.full((1024,), float(rank.rank + 1), device=device)
    dist.all_reduce(t)
    n = rank.world_size
    assert torch.all(t == n * (n + 1) / 2), t[:4]
    rank.barrier()
    print("nccl ok", os.environ["MASTER_PORT"])
dist.destroy_process_group()
"""
    n, run = _launch(tray_env, body)
    assert run.stdout.count("nccl ok") == n


def test_example_torch_ep_dispatch_on_gpus(tray_env):
    n = ngpus()
    if n < 2:
        pytest.skip(f"needs 2 GPUs, {n} visible")
    examples = REPO / "examples"
    run = tray_env.run([sys.executable, "-m", "tray", "launch", "-n", str(n), "--backend", "cuda", "--manifest",
                        str(examples / "torch_ep_dispatch.json"), str(examples / "torch_ep_dispatch.py"),
                        tray_env.marker], timeout_s=LAUNCH_BOUND_S)
    assert run.returncode == 0, run.output
    assert run.stdout.count("byte-exact (cuda") == n, run.stdout


def test_views_outlive_close_on_gpus(tray_env, manifest):
    body = """
from tray import UsageError
rank = tray.init()
me, n = rank.rank, rank.world_size
torch.from_dlpack(rank.buffer("y")).fill_(float(me + 1))
torch.cuda.synchronize()
rank.barrier()
peer = (me + 1) % n
kept = torch.from_dlpack(rank.peer_view("y", peer))     # a live view of an imported mapping
mine = torch.from_dlpack(rank.buffer("slots"))           # and of an own buffer
unused = rank.buffer("x")                                 # never handed out memory: released at close
rank.barrier()
rank.close()                                              # returns; the leased memory stays mapped
assert torch.all(kept == peer + 1), kept[0, :4]          # still readable after close (same GPU context)
mine.fill_(3.0)
torch.cuda.synchronize()
try:
    torch.from_dlpack(unused)
except UsageError as exc:
    assert "released" in str(exc), exc
else:
    raise AssertionError("a view of released memory")
del kept, mine
import gc; gc.collect()
assert rank._leases.live() == 0
torch.cuda.synchronize()
print("outlived close", me)
"""
    n, run = _launch(tray_env, body, "--manifest", manifest)
    assert run.stdout.count("outlived close") == n


def test_torch_tensors_are_collective_addresses_and_host_tensors_are_refused(tray_env, manifest):
    """The collectives take a torch tensor over tray memory as its address (its data_ptr), and refuse a tensor on
    the host by name: NCCL would fault on it."""
    n, run = _launch(tray_env, """
with tray.init() as rank:
    y = torch.from_dlpack(rank.buffer("y"))
    s = torch.from_dlpack(rank.buffer("s"))
    s.fill_(float(rank.rank + 1))
    torch.cuda.synchronize()
    c = rank.collectives("world")
    c.allreduce(s, y, 8, "f32")
    rank.synchronize()
    want = float(sum(range(1, rank.world_size + 1)))
    assert torch.all(y.flatten()[:8] == want).item(), y.flatten()[:8]
    try:
        c.allreduce(s.cpu(), y, 8, "f32")
    except tray.UsageError as exc:
        print("refused", rank.rank, "a tensor on the host" in str(exc), flush=True)
""", "--manifest", manifest)
    assert run.stdout.count("refused") == n and "False" not in run.stdout, run.stdout


def test_a_temporary_tensor_on_torchs_stream_is_reduced_whole_and_a_mistyped_one_refused(tray_env, manifest):
    """A temporary tensor given to a collective (`c.allreduce(torch.full(...), y, ...)`) was freed before the call
    used it (the wrapper dropped the last reference); on torch's stream torch's allocator orders its reuse after the
    collective. A bf16 tensor given to an f32 reduction is refused by name (its bytes were added as f32)."""
    n, run = _launch(tray_env, """
with tray.init() as rank:
    y = torch.from_dlpack(rank.buffer("y")).flatten()[:4096]
    c = rank.collectives("world")
    stream = torch.cuda.current_stream().cuda_stream
    for i in range(20):
        c.allreduce(torch.full((4096,), float(i + rank.rank), device=device), y, 4096, "f32", stream=stream)
        junk = [torch.ones(4096, device=device) for _ in range(4)]   # what would take a freed temporary's memory
        torch.cuda.synchronize()
        want = float(sum(i + r for r in range(rank.world_size)))
        assert torch.all(y == want).item(), (i, y[:4])
    try:
        c.allreduce(torch.zeros(8, dtype=torch.bfloat16, device=device), y, 8, "f32", stream=stream)
    except tray.UsageError as exc:
        print("typed", rank.rank, "a bfloat16 tensor" in str(exc), flush=True)
    print("temporaries", rank.rank, flush=True)
""", "--manifest", manifest)
    assert run.stdout.count("temporaries") == n and run.stdout.count("typed") == n, run.output
    assert "False" not in run.stdout, run.stdout
