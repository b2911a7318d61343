"""Real trays on GPUs: peer writes checked byte for byte, barrier, drop, NCCL vs numpy, graphs."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import MANIFESTS, gpu_ranks, visible_gpus

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "host"))

pytestmark = pytest.mark.gpu
FILL = str(MANIFESTS / "peer_fill.json")


def ngpus() -> int:
    return gpu_ranks()


def fill_gpus() -> int:
    """Ranks for a tray of peer_fill.json, whose `pairs` group needs an even count: skips below 2 GPUs."""
    n = ngpus() // 2 * 2
    if n < 2:
        pytest.skip("peer_fill.json pairs its ranks: needs 2 GPUs")
    return n


def test_every_rank_writes_every_peer_and_checks_every_byte(tray_env):
    body = """
    from tray.backend.host.twins import peer_fill_words
    with tray.init() as rank:
        me, n = rank.rank, rank.world_size
        words = rank.buffer("fill").shape[0] // n
        peers = rank.peers("fill")
        kernel = rank.kernel("peer_fill")
        for seed in (7, 1234567):
            kernel.launch((64, 1, 1), (256, 1, 1), [peers.table_ptr, n, me, words, seed])
            rank.backend.synchronize()
            rank.barrier()
            got = rank.read("fill").reshape(n, words)
            for writer in range(n):
                assert (got[writer] == peer_fill_words(seed, writer, me, words)).all(), (seed, writer)
            rank.barrier()
        print("checked", n * words * 4, "bytes")
    """
    n = fill_gpus()
    run = tray_env.launch(n, body, "--manifest", FILL, "--var", "words=1048576", backend="cuda", timeout_s=180)
    assert run.returncode == 0, run.output
    assert run.stdout.count(f"checked {n * 1048576 * 4} bytes") == n


def test_nccl_collectives_match_numpy(tray_env):
    body = """
    with tray.init() as rank:
        me, n = rank.rank, rank.world_size
        count = rank.buffer("send").shape[0] // n
        rng = np.random.default_rng(99)
        inputs = rng.integers(-1000, 1000, (n, n * count)).astype(np.float32)  # exact sums in f32
        c = rank.collectives("world")
        send, recv = rank.buffer("send"), rank.buffer("recv")
        rank.write("send", inputs[me])
        c.allreduce(send.ptr, recv.ptr, n * count, "f32"); rank.backend.synchronize()
        assert np.array_equal(rank.read("recv"), inputs.sum(0))
        c.allgather(send.ptr, recv.ptr, count, "f32"); rank.backend.synchronize()
        assert np.array_equal(rank.read("recv"), np.concatenate([inputs[i][:count] for i in range(n)]))
        c.reducescatter(send.ptr, recv.ptr, count, "f32"); rank.backend.synchronize()
        assert np.array_equal(rank.read("recv")[:count], inputs.sum(0)[me * count:(me + 1) * count])
        c.alltoall(send.ptr, recv.ptr, count, "f32"); rank.backend.synchronize()
        want = np.concatenate([inputs[i][me * count:(me + 1) * count] for i in range(n)])
        assert np.array_equal(rank.read("recv"), want)
        # the same allreduce captured in a graph and replayed
        g = rank.backend.capture(lambda: c.allreduce(send.ptr, recv.ptr, n * count, "f32"))
        rank.write("recv", np.zeros(n * count, np.float32))
        g.replay(); rank.backend.synchronize(); g.close()
        assert np.array_equal(rank.read("recv"), inputs.sum(0))
        print("nccl ok")
    """
    n = fill_gpus()
    run = tray_env.launch(n, body, "--manifest", FILL, backend="cuda", timeout_s=180)
    assert run.returncode == 0, run.output
    assert run.stdout.count("nccl ok") == n


def test_nccl_joined_early_while_ranks_start(tray_env, tmp_path):
    """`--join-collectives early`: every rank's groups joined on a thread during its start (ids from the head);
    the first allreduce takes them, with no tray-wide step, and gives numpy's sums eagerly and in a graph.
    `auto` joins early for a manifest whose program has a collective op, lazily for one without."""
    manifest = tmp_path / "sum.json"
    manifest.write_text(json.dumps({
        "format": 1, "name": "sum", "vars": {"count": 4096},
        "groups": [{"name": "world", "ranks": "all"}, {"name": "solo", "size": 1}],
        "buffers": [{"name": "a", "dtype": "f32", "shape": ["count"]},
                    {"name": "b", "dtype": "f32", "shape": ["count"]}],
        "programs": [{"name": "sum", "ops": [{"op": "nccl", "collective": "allreduce", "group": "world",
                                              "send": "a", "recv": "b", "count": "count", "dtype": "f32"}]}]}))
    body = """
    import os, time
    with tray.init() as rank:
        me, n = rank.rank, rank.world_size
        rng = np.random.default_rng(11)
        inputs = rng.integers(-1000, 1000, (n, 4096)).astype(np.float32)
        rank.write("a", inputs[me])
        rank.run("sum"); rank.backend.synchronize()
        assert np.array_equal(rank.read("b"), inputs.sum(0))
        c = rank.collectives("world")
        g = rank.backend.capture(lambda: c.allreduce(rank.buffer("a").ptr, rank.buffer("b").ptr, 4096, "f32"))
        rank.write("b", np.zeros(4096, np.float32))
        g.replay(); rank.backend.synchronize(); g.close()
        assert np.array_equal(rank.read("b"), inputs.sum(0))
        t = rank.timings
        print(f"joined {'early' if 'nccl_early' in t else 'lazily'} in {t.get('nccl_early', t['collectives']):.3f} s, "
              f"waited {t['collectives']:.3f} s")
        # the head's id process ends by itself once its NCCL roots served every member
        def id_process_alive():
            for p in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{p}/cmdline", "rb") as f:  # a zombie's is empty
                        if os.getpgid(int(p)) == os.getpgid(0) and b"tray.collectives.idmaker" in f.read():
                            return True
                except OSError:
                    pass
            return False
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5.0 and id_process_alive():
            time.sleep(0.01)
        print(f"id process gone after {time.monotonic() - t0:.3f} s" if time.monotonic() - t0 < 5.0 else
              "id process still there")
    """
    n = ngpus()
    for mode, want in (("early", "early"), ("auto", "early"), ("lazy", "lazily")):
        run = tray_env.launch(n, body, "--manifest", str(manifest), "--join-collectives", mode, backend="cuda",
                              timeout_s=180)
        assert run.returncode == 0, run.output
        assert run.stdout.count(f"joined {want} in") == n, (mode, run.output)
        assert run.stdout.count("id process gone after") == n, run.output
        assert ("NCCL: the ranks join their groups on a thread" in run.stderr) is (want == "early"), run.stderr
    manifest_plain = tmp_path / "plain.json"
    doc = json.loads(manifest.read_text())
    del doc["programs"]
    manifest_plain.write_text(json.dumps(doc))
    body_plain = body.replace('rank.run("sum")', 'c0 = rank.collectives("world"); c0.allreduce(rank.buffer("a").ptr, '
                              'rank.buffer("b").ptr, 4096, "f32")')
    run = tray_env.launch(n, body_plain, "--manifest", str(manifest_plain), backend="cuda", timeout_s=180)
    assert run.returncode == 0, run.output
    assert run.stdout.count("joined lazily in") == n, run.output


def test_a_tray_that_fails_before_its_ranks_join_leaves_no_nccl_root_behind(tmp_path):
    """An early-join tray whose ranks fail before joining, twice (--max-restarts 1), run from a long-lived Python:
    NCCL's bootstrap roots (a listening socket and a thread each) lived in the head before; now they live in the
    head's id process, which the teardown ends with the tray."""
    import subprocess

    manifest = tmp_path / "sum.json"
    manifest.write_text(json.dumps({
        "format": 1, "name": "sum", "groups": [{"name": "world", "ranks": "all"}, {"name": "solo", "size": 1}],
        "buffers": [{"name": "a", "dtype": "f32", "shape": [4]}, {"name": "b", "dtype": "f32", "shape": [4]}],
        "programs": [{"name": "sum", "ops": [{"op": "nccl", "collective": "allreduce", "group": "world",
                                              "send": "a", "recv": "b", "count": 4, "dtype": "f32"}]}]}))
    code = f"""
import os, sys, psutil
from tray.launch import run_tray
from tray.launch.spec import TraySpec
def listening():
    return sorted(c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN")
def id_processes():
    return [p.pid for p in psutil.process_iter(["cmdline"]) if "tray.collectives.idmaker" in (p.info["cmdline"] or [])]
before = listening()
spec = TraySpec(nprocs={ngpus()}, cmd=(sys.executable, "-c", "import sys; sys.exit(1)"), backend="cuda",
                manifest={str(manifest)!r}, join_collectives="early", max_restarts=1, quiet=True)
result = run_tray(spec)
print("attempts", result.attempts, "exit", result.exit_code)
print("new listening sockets", [p for p in listening() if p not in before], "id processes", id_processes())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "attempts 2 exit 1" in out.stdout, out.stdout + out.stderr
    assert "new listening sockets [] id processes []" in out.stdout, out.stdout + out.stderr


def test_nccl_windows_on_tray_buffers(tray_env, tmp_path):
    """Tray buffers (local and exported) registered as symmetric NCCL windows: an allreduce on them, eager and
    captured, gives numpy's sums; the windows go before their communicator at close."""
    manifest = tmp_path / "windows.json"
    manifest.write_text(json.dumps({
        "format": 1, "name": "windows", "vars": {"count": 1 << 20},
        "groups": [{"name": "world", "ranks": "all"}],
        "buffers": [{"name": "a", "dtype": "f32", "shape": ["count"]},
                    {"name": "b", "dtype": "f32", "shape": ["count"], "export": True}]}))
    body = """
    with tray.init() as rank:
        me, n = rank.rank, rank.world_size
        a, b = rank.buffer("a"), rank.buffer("b")
        c = rank.collectives("world")
        c.register_window(a.ptr, a.nbytes)
        c.register_window(b.ptr, b.nbytes)
        rng = np.random.default_rng(5)
        inputs = rng.integers(-1000, 1000, (n, a.shape[0])).astype(np.float32)  # exact sums in f32
        rank.write("a", inputs[me])
        for count in (1, 1000, a.shape[0]):
            rank.write("b", np.zeros(a.shape[0], np.float32))
            c.allreduce(a.ptr, b.ptr, count, "f32"); rank.backend.synchronize()
            got = rank.read("b")
            assert np.array_equal(got[:count], inputs.sum(0)[:count]) and not got[count:].any(), count
        g = rank.backend.capture(lambda: c.allreduce(a.ptr, b.ptr, a.shape[0], "f32"))
        rank.write("b", np.zeros(a.shape[0], np.float32))
        g.replay(); rank.backend.synchronize(); g.close()
        assert np.array_equal(rank.read("b"), inputs.sum(0))
        print("windows ok")
    """
    n = ngpus()
    run = tray_env.launch(n, body, "--manifest", str(manifest), backend="cuda", timeout_s=180)
    assert run.returncode == 0, run.output
    assert run.stdout.count("windows ok") == n


def test_barrier_in_graph_and_drop(tray_env, tmp_path):
    n = ngpus()
    out = tmp_path / "gate.json"
    run = tray_env.run([sys.executable, "-m", "tray", "gate", "peer-barrier", "-n", str(n), "--backend", "cuda",
                        "--iters", "200", "--json", str(out)], timeout_s=180)
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    assert report["passed"] and report["captured_us"] > 0
    if n < 2:
        return
    out = tmp_path / "drop.json"
    run = tray_env.run([sys.executable, "-m", "tray", "gate", "peer-barrier", "-n", str(n), "--backend", "cuda",
                        "--drop", str(n - 1), "--json", str(out)], timeout_s=180)
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    assert all(c["ok"] for c in report["drop_checks"]) and len(report["drop_checks"]) == n - 1


def test_barrier_stress_under_graphs_with_skew_and_a_wrong_word(tray_env, tmp_path):
    """Producer -> barrier -> consumer through peer pointers, no host sync, graphs replayed, skewed ranks:
    zero wrong words; and one injected wrong word makes the gate fail, naming its writer."""
    n = ngpus()
    if n < 2:
        pytest.skip("the stress needs two GPUs")
    base = [sys.executable, "-m", "tray", "gate", "peer-barrier", "-n", str(n), "--backend", "cuda", "--stress",
            "--iters", "500", "--replays", "4"]
    out = tmp_path / "stress.json"
    run = tray_env.run([*base, "--json", str(out)], timeout_s=180)
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    assert report["passed"] and report["mismatches"] == 0
    assert all(r["stress"]["rounds"] == 2500 for r in report["per_rank"])
    out = tmp_path / "corrupt.json"
    run = tray_env.run([*base, "--corrupt", "1", "--json", str(out)], timeout_s=180)
    assert run.returncode == 1, run.output
    report = json.loads(out.read_text())
    victim = report["per_rank"][2 % n]["stress"]
    assert report["mismatches"] == 1 and victim["bad_writers"] == [1] and victim["first_bad_round"] == 3


def test_rank_hangs_in_gpu_barrier_is_named(tray_env):
    n = ngpus()
    if n < 2:
        pytest.skip("needs 2 GPUs")
    run = tray_env.launch(n, """
    with tray.init() as rank:
        if rank.rank == 1:
            time.sleep(600)
        rank.barrier(timeout_s=1.0)
    """, backend="cuda", timeout_s=120)
    assert run.returncode == 1, run.output
    line = next(ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED"))
    assert "BarrierTimeout" in line and "for rank 1" in line


def test_a_collective_without_its_peer_ends_in_a_named_sync_timeout(tray_env):
    n = ngpus()
    if n < 2:
        pytest.skip("needs 2 GPUs")
    run = tray_env.launch(n, """
    from tray.errors import SyncTimeout
    os.environ["TRAY_SYNC_TIMEOUT_S"] = "5"
    with tray.init() as rank:
        rank.run("step")  # every rank: NCCL joined, the plan built
        rank.synchronize()
        rank.exchange("warm", 0)
        if rank.rank != 0:
            time.sleep(600)
        t0 = time.monotonic()
        rank.run("step")  # rank 0 alone: its allreduce waits for peers that never come
        try:
            rank.synchronize()
        except SyncTimeout:
            print(f"sync timed out after {time.monotonic() - t0:.1f} s", flush=True)
            raise
    """, "--manifest", str(MANIFESTS / "program_smoke.json"), backend="cuda", timeout_s=150)
    assert run.returncode == 1, run.output
    waited = float(run.stdout.split("sync timed out after ")[1].split(" s")[0])
    assert 5.0 <= waited < 15.0, run.output
    line = next(ln for ln in run.stderr.splitlines() if ln.startswith("tray: FAILED"))
    assert "SyncTimeout" in line, run.output
    assert "program 'step'" in run.output and "nccl allreduce on group 'world'" in run.output
    assert "peer may have diverged" in run.output


def test_programs_on_gpu(tray_env):
    from test_programs import BODY

    n = ngpus()
    run = tray_env.launch(n, BODY, "--manifest", str(MANIFESTS / "program_smoke.json"), backend="cuda",
                          timeout_s=180)
    assert run.returncode == 0, run.output
    assert run.stdout.count("programs ok") == n


NCCL_THEN_WAIT = """
with tray.init() as rank:
    n = rank.world_size
    c = rank.collectives("world")
    send, recv = rank.buffer("send"), rank.buffer("recv")
    c.allreduce(send.ptr, recv.ptr, n, "f32"); rank.backend.synchronize()
    print("up", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("watchdog_dies_too", [False, True])
def test_head_sigkilled_after_nccl_leaves_no_segment(tray_env, watchdog_dies_too):
    """NCCL's /dev/shm segments of SIGKILLed ranks: removed by the watchdog, or by the next launch when
    the watchdog died with the head (the fixture checks /dev/shm and the jobs root afterwards)."""
    import signal
    import subprocess
    import time

    import psutil

    n = fill_gpus()
    if n < 2:
        pytest.skip("needs 2 GPUs")
    head = subprocess.Popen(tray_env.command(n, NCCL_THEN_WAIT, "--manifest", FILL, backend="cuda"),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=tray_env.env(),
                            cwd=str(tray_env.tmp))
    try:
        seen, deadline = 0, time.monotonic() + 120
        while seen < n and time.monotonic() < deadline:
            seen += head.stdout.readline().strip().endswith("up")
        assert seen == n
        time.sleep(1.5)  # the head samples its ranks' mappings once a second
        if watchdog_dies_too:
            for c in psutil.Process(head.pid).children():
                if "tray.launch.watchdog" in " ".join(c.cmdline()):
                    c.kill()
        head.send_signal(signal.SIGKILL)
        head.wait(timeout=10)
    finally:
        if head.poll() is None:
            head.kill()
        head.stdout.close()
    if watchdog_dies_too:
        time.sleep(2)
        run = tray_env.launch(1, "pass")
        assert run.returncode == 0, run.output


def test_more_ranks_than_gpus_refused_before_spawning(tray_env, monkeypatch):
    monkeypatch.delenv("TRAY_SHARE_GPUS", raising=False)  # refused unless ranks may share GPUs
    n = visible_gpus() + 1
    run = tray_env.launch(n, "raise SystemExit('a rank was spawned')", backend="cuda")
    assert run.returncode == 2, run.output
    assert f"-n {n} needs {n} GPUs (one per rank), {n - 1} visible" in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1 and "a rank was spawned" not in run.output


def test_cuda_ranks_get_nccl_runtime_connect_and_the_barrier_timeout(tray_env):
    body = """
    with tray.init() as rank:
        print("env", os.environ.get("NCCL_RUNTIME_CONNECT"), rank.barrier_timeout_s)
    """
    n = min(2, ngpus())
    run = tray_env.launch(n, body, "--barrier-timeout-s", "7", backend="cuda")
    assert run.returncode == 0, run.output
    assert run.stdout.count("env 0 7.0") == n, run.stdout


def test_kernel_arguments_and_objects_kept_past_close_on_cuda(tray_env, tmp_path):
    """On cuda too: a peer table given as a kernel argument is its table's address, a grid of 0 is refused, and a
    barrier, collectives, kernel or bound launch kept past close() is a UsageError (not a launch on a destroyed
    context, nor a read of freed flags)."""
    manifest = tmp_path / "one.json"
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "peer_fill.cu").write_bytes((MANIFESTS / "kernels" / "peer_fill.cu").read_bytes())
    manifest.write_text(json.dumps({
        "format": 1, "name": "one", "vars": {"words": 1024},
        "buffers": [{"name": "fill", "dtype": "u32", "shape": ["world_size * words"], "export": True},
                    {"name": "x", "dtype": "f32", "shape": [64]}],
        "kernels": [{"name": "peer_fill", "source": "kernels/peer_fill.cu", "entry": "tray_peer_fill",
                     "peers": True}]}))
    body = """
    from tray.backend.host.twins import peer_fill_words
    from tray.errors import UsageError

    def refused(call):
        try:
            call()
        except UsageError as exc:
            print("refused:", str(exc).splitlines()[0], flush=True)
        else:
            print("taken", flush=True)

    rank = tray.init()
    me, n = rank.rank, rank.world_size
    words = rank.buffer("fill").shape[0] // n
    k, bo, c = rank.kernel("peer_fill"), rank.barrier_of("world"), rank.collectives("world")
    bound = k.bind((8, 1, 1), (128, 1, 1), [rank.peers("fill"), n, me, words, 5])   # the peer table itself
    bound.launch()
    rank.synchronize()
    rank.barrier()
    got = rank.read("fill").reshape(n, words)
    assert all((got[w] == peer_fill_words(5, w, me, words)).all() for w in range(n))
    refused(lambda: k.launch((0, 1, 1), (128, 1, 1), [rank.peers("fill"), n, me, words, 5]))
    x = rank.buffer("x")
    c.allreduce(x, x, 64, "f32")
    rank.synchronize()
    rank.close()
    for call in (lambda: bo.wait(1.0), lambda: c.allreduce(x.ptr, x.ptr, 64, "f32"), bound.launch,
                 lambda: k.launch((1, 1, 1), (32, 1, 1), [0, n, me, words, 5])):
        refused(call)
    print("ok", flush=True)
    """
    n = min(ngpus(), 2)
    run = tray_env.launch(n, body, "--manifest", str(manifest), backend="cuda", timeout_s=180)
    assert run.returncode == 0, run.output
    for r in range(n):
        lines = [ln.split(" ", 2)[2] for ln in run.stdout.splitlines() if ln.startswith(f"[rank {r}] ")]
        assert "taken" not in lines and lines[-1] == "ok", lines
        refused = [ln for ln in lines if ln.startswith("refused:")]
        assert len(refused) == 5, lines
        assert "grid must be an int or 1-3 ints, each >= 1" in refused[0], refused
        assert all("used after close() of its rank" in ln for ln in refused[1:]), refused
