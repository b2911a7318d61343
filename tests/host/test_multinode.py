"""A job of two trays on this machine over 127.0.0.1: two `tray launch --nnodes 2` processes, 2 ranks each,
host backend; the heads talk to node 0's root over TCP with CURVE."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import MANIFESTS, Run

from tray.launch.root import TOKEN_FAILURES

FILL = str(MANIFESTS / "peer_fill.json")
PARK = str(MANIFESTS / "park.json")
TOKEN = "f00dfeed0123456789abcdefcafe5678"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tray", "launch", "-n", "2", "--backend", "host", *args]


def start_job(tray_env, body: str, *launch_args: str, nnodes: int = 2, tokens: tuple[str, ...] = (),
              node_args: dict[int, tuple[str, ...]] | None = None, nodes: tuple[int, ...] | None = None,
              port: int | None = None) -> list[subprocess.Popen]:
    """One `tray launch` per node (or per node of `nodes`), all started at once; node i gets tokens[i]
    (default TOKEN)."""
    port = port or free_port()
    prog = tray_env.script(body)
    procs = []
    for node in range(nnodes) if nodes is None else nodes:
        env = tray_env.env()
        env["TRAY_JOB_TOKEN"] = tokens[node] if node < len(tokens) else TOKEN
        cmd = launch_cmd(*launch_args, "--nnodes", str(nnodes), "--node-rank", str(node),
                         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test", *(node_args or {}).get(node, ()),
                         "--", sys.executable, str(prog), tray_env.marker)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      cwd=str(tray_env.tmp)))
    return procs


def finish(procs: list[subprocess.Popen], timeout_s: float = 60.0) -> list[Run]:
    """Every node's result; their pipes read at once (one at a time, a node writing more than a pipe holds would
    block on the pipe nobody reads yet)."""
    import threading

    runs: list[Run | None] = [None] * len(procs)
    t0 = time.monotonic()

    def wait(i: int, p: subprocess.Popen) -> None:
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            err += "\n(test: killed after the timeout)"
        runs[i] = Run(p.returncode, out, err, time.monotonic() - t0)

    threads = [threading.Thread(target=wait, args=(i, p)) for i, p in enumerate(procs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in runs if r is not None]


def test_two_nodes_exchange_barrier_collectives_peer_tables(tray_env):
    body = """
    with tray.init() as rank:
        me, n = rank.rank, rank.world_size
        assert n == 4 and rank.local_rank == me % 2 and os.environ["GROUP_RANK"] == str(me // 2)
        assert os.environ["WORLD_SIZE"] == "4" and os.environ["LOCAL_WORLD_SIZE"] == "2"
        assert "TRAY_JOB_TOKEN" not in os.environ
        assert rank.exchange("who", [me, os.getpid()])[me] == [me, os.getpid()]
        world = rank.barrier_of("world")                 # world spans both nodes: hierarchical
        assert world.path == "hierarchical" and world.relayed.path == "relayed", world
        assert world.local_group.members == ((0, 1) if me < 2 else (2, 3)) and world.is_leader == (me % 2 == 0)
        for _ in range(20):
            rank.barrier()
        world.relayed.wait(5.0)
        graph = rank.backend.capture(lambda: [world.launch(5.0) for _ in range(3)])
        graph.replay()
        rank.synchronize()
        assert world.epoch == 23, world.epoch             # 20, then 3 replayed
        # pairs {0,1} and {2,3} stay within a node: peer tables and the shared-memory barrier
        pair = rank.peers("pair")
        assert len(pair.ptrs) == 2 and pair.ptrs[me % 2] == rank.buffer("pair").ptr
        rank.write("pair", np.full(2, 100 + me, np.uint32))
        rank.barrier("pairs")
        from tray.backend.host import view
        peer = view(pair.ptrs[1 - me % 2], 8).view(np.uint32)
        assert list(peer) == [100 + (me ^ 1)] * 2, list(peer)
        try:
            rank.peers("fill")
        except tray.UsageError as exc:
            assert "spans nodes" in str(exc), exc
        else:
            raise AssertionError("a peer table over a spanning group")
        c = rank.collectives("world")
        count = 256
        inputs = np.random.default_rng(7).standard_normal((n, count)).astype(np.float32)
        rank.write("send", inputs[me])
        send, recv = rank.buffer("send"), rank.buffer("recv")
        c.allreduce(send.ptr, recv.ptr, count, "f32")
        ref = inputs[0].copy()
        for i in range(1, n):
            ref += inputs[i]
        assert np.array_equal(rank.read("recv")[:count], ref)
        c.allgather(send.ptr, recv.ptr, count // 4, "f32")
        assert np.array_equal(rank.read("recv")[:count], np.concatenate([inputs[i][:count // 4] for i in range(n)]))
        rank.barrier()
        print("node job ok", me)
    """
    runs = finish(start_job(tray_env, body, "--manifest", FILL, "--var", "count=256", "--var", "words=64"))
    for node, run in enumerate(runs):
        assert run.returncode == 0, run.output
        for r in (2 * node, 2 * node + 1):
            assert f"[rank {r}] node job ok {r}" in run.stdout, run.output


def test_two_nodes_park_wake_all_or_nothing(tray_env):
    body = """
    from tray.errors import NoRoom
    with tray.init() as rank:
        me, b = rank.rank, rank.backend
        s = rank.lease(2)
        data = np.random.default_rng(me).integers(0, 256, s.nbytes, dtype=np.uint8)
        for i in range(s.npages):
            b.write(s.ptr(i), data[i * s.page_nbytes:(i + 1) * s.page_nbytes])
        parked = rank.park(s)
        woken = rank.wake(parked)
        got = np.concatenate([b.read(woken.ptr(i), woken.page_nbytes) for i in range(woken.npages)])
        assert np.array_equal(got, data)
        big = rank.lease(5 if me == 3 else 1)           # rank 3 (node 1) has no host room for 5
        try:
            rank.park(big)
        except NoRoom as exc:
            print("noroom", me, "rank 3" in str(exc), flush=True)
        else:
            raise AssertionError("park should have been refused on every rank")
        print("park ok", me)
    """
    args = ("--manifest", PARK, "--var", "page_nbytes=4096", "--var", "pages=8", "--var", "host_pages=4")
    runs = finish(start_job(tray_env, body, *args))
    for node, run in enumerate(runs):
        assert run.returncode == 0, run.output
        for r in (2 * node, 2 * node + 1):
            assert f"[rank {r}] noroom {r} True" in run.stdout and f"[rank {r}] park ok {r}" in run.stdout, run.output


def _root_cause(run: Run) -> str:
    return next(line for line in run.stderr.splitlines() if line.startswith("tray: FAILED:"))


@pytest.mark.parametrize("line_nbytes", [0, 65_000], ids=["plain", "long_lines"])
def test_a_rank_failing_on_node_1_is_named_by_both_heads(tray_env, line_nbytes):
    """With long last lines too: 20 lines of 65 kB are over one control message, and node 1's head failed
    with a WireError (exit 2) while node 0 named node 1 lost; the failure is cut to fit now."""
    body = f"""
    with tray.init() as rank:
        rank.barrier()
        if rank.rank == 3:
            for i in range({20 if line_nbytes else 0}):
                print("z" * {line_nbytes}, flush=True)
            raise ValueError("rank three gives up")
        rank.barrier(timeout_s=30)   # the others wait while rank 3 writes its lines
    """
    runs = finish(start_job(tray_env, body))
    assert all(run.returncode != 0 for run in runs), [r.output for r in runs]
    causes = [_root_cause(run) for run in runs]
    assert causes[0] == causes[1], causes
    assert "node 1" in causes[0] and "rank 3" in causes[0] and "rank three gives up" in causes[0], causes


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_head_is_named_within_the_timeout(tray_env, victim):
    """Node 1's head killed: the root names node 1. Node 0's head (the root) killed: node 1 names the lost
    root and stops its ranks. Either way within the heartbeat timeout, and nothing is left (the killed
    head's watchdog removes its ranks and its job dir; the fixture checks)."""
    body = """
    with tray.init() as rank:
        open(f"up-{rank.rank}", "w").close()
        time.sleep(60)
    """
    survivor = 1 - victim
    procs = start_job(tray_env, body, node_args={survivor: ("--node-heartbeat-timeout-s", "1.5")})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(list(tray_env.tmp.glob("up-*"))) < 4:
        time.sleep(0.05)
    assert len(list(tray_env.tmp.glob("up-*"))) == 4
    t_kill = time.monotonic()
    os.kill(procs[victim].pid, signal.SIGKILL)   # its ranks die with it (PR_SET_PDEATHSIG)
    run = finish([procs[survivor]], timeout_s=20)[0]
    finish([procs[victim]])
    assert run.returncode != 0 and time.monotonic() - t_kill < 1.5 + 5, run.output
    cause = _root_cause(run)
    if victim == 1:
        assert "node 1" in cause and "lost" in cause and "no heartbeat" in cause, run.output
        # named once its silence passes the timeout, not some multiple of it: the wall-clock bound above leaves room
        # for a slow machine's start and teardown, the silence the root measured does not
        silent = re.search(r"no heartbeat for ([0-9.]+) s \(timeout 1\.5 s\)", cause)
        assert silent and 1.5 <= float(silent.group(1)) < 4.0, cause  # 3 x the timeout would be 4.5
    else:
        assert "node 1: lost the root (node 0 at 127.0.0.1:" in cause and "nothing heard" in cause, run.output


@pytest.mark.parametrize("wait", ["barrier", "exchange"])
def test_a_wait_that_runs_out_before_a_killed_node_is_lost_names_that_nodes_silence(tray_env, wait):
    """Node 1's head killed while node 0's ranks wait for its ranks in a spanning barrier (or an exchange) that gives
    up (after 1 s, or 2 s) before the node's heartbeat timeout (5 s): the wait's end is the first failure, and the
    root adds that the node of the missing ranks has been silent, so the verdict points at the node, not at a slow
    rank."""
    body = """
    with tray.init() as rank:
        rank.barrier()
        if rank.rank >= 2:
            open(f"up-{rank.rank}", "w").close()
            time.sleep(60)
        WAIT
    """.replace("WAIT", "rank.barrier(timeout_s=1)   # the leaders' step across nodes waits 2 s of it"
                if wait == "barrier" else "rank.exchange('x', 1, timeout_s=2)")
    procs = start_job(tray_env, body)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(list(tray_env.tmp.glob("up-*"))) < 2:
        time.sleep(0.05)
    assert len(list(tray_env.tmp.glob("up-*"))) == 2
    os.kill(procs[1].pid, signal.SIGKILL)   # its ranks die with it (PR_SET_PDEATHSIG)
    run = finish([procs[0]], timeout_s=20)[0]
    finish([procs[1]])
    assert run.returncode != 0, run.output
    cause = _root_cause(run)
    if wait == "barrier":
        assert "BarrierTimeout" in cause and re.search(r"for rank 2\b", cause), run.output
    else:
        assert "no decision on exchange 'x'" in cause, run.output
    # the node's silence first: the wait's own text can only guess (a slower rank, a longer timeout)
    assert re.match(r"tray: FAILED: node 1 \(.*, head pid \d+\), which holds ranks? 2(,3)?, has been silent for "
                    r"[0-9.]+ s \(its head beats every 0.5 s; lost after 5 s\): its head was probably killed or "
                    r"stopped, or its machine or network is down; what waited for it, on node 0: rank [01] ", cause), \
        run.output


def test_a_root_head_that_was_stopped_says_so_of_itself(tray_env):
    """Node 0's head (the root) SIGSTOPped past the heartbeat timeout, then continued: node 1 names the lost root;
    node 0 says it did not run itself, instead of blaming 'node 0' (its own root) or counting node 1 lost."""
    body = """
    with tray.init() as rank:
        open(f"up-{rank.rank}", "w").close()
        time.sleep(60)
    """
    procs = start_job(tray_env, body, "--node-heartbeat-timeout-s", "1.5")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(list(tray_env.tmp.glob("up-*"))) < 4:
        time.sleep(0.05)
    assert len(list(tray_env.tmp.glob("up-*"))) == 4
    os.kill(procs[0].pid, signal.SIGSTOP)
    time.sleep(3.0)
    os.kill(procs[0].pid, signal.SIGCONT)
    runs = finish(procs, timeout_s=30)
    assert all(run.returncode != 0 for run in runs), [r.output for r in runs]
    assert "node 1: lost the root (node 0 at 127.0.0.1:" in _root_cause(runs[1]), runs[1].output
    cause = _root_cause(runs[0])
    assert re.search(r"node 0: this head did not run for \d+\.\d s \(stopped, suspended, or starved of CPU\)", cause), \
        runs[0].output
    assert "lost: no heartbeat" not in runs[0].stderr, runs[0].output


def test_a_head_stopped_after_its_node_was_done_ends_with_the_job(tray_env):
    """Node 1's head SIGSTOPped past its heartbeat timeout once its ranks ended (its node done): the job ends while it
    is stopped, and once continued it reads the job's end the root sent and exits 0, instead of failing as a node the
    others counted lost."""
    body = """
    with tray.init() as rank:
        rank.barrier()
    if rank.rank < 2:
        time.sleep(2)   # node 0's ranks end later: the root ends the job while node 1's head is stopped
    else:
        open(f"done-{rank.rank}", "w").close()
    """
    procs = start_job(tray_env, body, node_args={1: ("--node-heartbeat-timeout-s", "1")})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(list(tray_env.tmp.glob("done-*"))) < 2:
        time.sleep(0.05)
    time.sleep(0.5)   # node 1's head sees its ranks' exits and tells the root
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        node0 = finish([procs[0]], timeout_s=20)[0]
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    node1 = finish([procs[1]], timeout_s=20)[0]
    assert node0.returncode == 0, node0.output
    assert node1.returncode == 0, node1.output


@pytest.mark.parametrize("victim, sig", [(1, signal.SIGINT), (0, signal.SIGTERM)])
def test_an_interrupted_head_stops_the_job_at_once_naming_itself(tray_env, victim, sig):
    """Ctrl-C (or SIGTERM) to one node's head: it exits 130, and the other head hears it as the job's root cause
    at once, not as a lost node a heartbeat timeout (5 s here) later. A tray-wide step left waiting is reported
    only for ranks that take part in it (a node leaders' step: the leader, never its other ranks)."""
    body = """
    with tray.init() as rank:
        open(f"up-{rank.rank}", "w").close()
        while True:
            rank.barrier()
    """
    procs = start_job(tray_env, body)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(list(tray_env.tmp.glob("up-*"))) < 4:
        time.sleep(0.05)
    assert len(list(tray_env.tmp.glob("up-*"))) == 4
    time.sleep(0.3)
    t_signal = time.monotonic()
    procs[victim].send_signal(sig)
    survivor = finish([procs[1 - victim]], timeout_s=20)[0]
    interrupted = finish([procs[victim]])[0]
    assert interrupted.returncode == 130, interrupted.output
    assert survivor.returncode == 1 and time.monotonic() - t_signal < 3.0, survivor.output
    assert _root_cause(survivor) == (f"tray: FAILED: node {victim}: its head was interrupted ({sig.name}); the job "
                                     "stops"), survivor.output
    for line in survivor.stderr.splitlines():  # (the barrier may as well be in its node-local stage then)
        if "was still waiting for" in line and "the leaders step" in line:
            named = {int(r) for rs in re.findall(r"ranks? ([\d,]+) \(node", line) for r in rs.split(",")}
            assert named and named <= {0, 2}, survivor.output  # node leaders only


def test_a_node_whose_ranks_never_join_is_named_within_the_timeout(tray_env):
    """A job of several nodes keeps --timeout-s from the spawn on every node: a node whose ranks never call
    tray.init() is named, not left waiting (one host instead waits for a first contact)."""
    body = """
    if os.environ["GROUP_RANK"] == "1":
        time.sleep(60)
    with tray.init() as rank:
        rank.barrier()
    """
    runs = finish(start_job(tray_env, body, "--timeout-s", "3"), timeout_s=40)
    assert all(run.returncode == 3 for run in runs), [r.output for r in runs]
    assert "did not offer within 3 s of the spawn" in runs[1].stderr, runs[1].output
    assert all(run.seconds < 20 for run in runs), [r.seconds for r in runs]


def test_ranks_that_waited_for_a_slower_node_to_offer_are_not_blamed_for_it(tray_env):
    """Node 1 offers after node 0's --timeout-s from its spawn has passed (its ranks start later, as on a node started
    later, within its own deadline): node 0's ranks, offered long before and waiting for the table, then join within
    moments; the time they waited for node 1 is not theirs to answer for, so the job runs, instead of failing at the
    table's arrival with 'rank 0 did not report ready within 3 s of the spawn'."""
    body = """
    if os.environ["GROUP_RANK"] == "1":
        time.sleep(5)
    with tray.init() as rank:
        rank.barrier()
    """
    runs = finish(start_job(tray_env, body, node_args={0: ("--timeout-s", "3"), 1: ("--timeout-s", "60")}),
                  timeout_s=40)
    for run in runs:
        assert run.returncode == 0, run.output


def test_a_root_host_that_does_not_resolve_is_one_line_not_a_hang(tray_env):
    env = tray_env.env()
    env["TRAY_JOB_TOKEN"] = TOKEN
    run = tray_env.run(launch_cmd("--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "nosuchhost.invalid:29500",
                                  "--timeout-s", "3", "--", sys.executable, "-c", "pass"), timeout_s=30, env=env)
    assert run.returncode == 2, run.output
    # asked again until --timeout-s (a Kubernetes service's name may resolve only after its pod starts), then named
    # with where it came from
    assert "the root's host 'nosuchhost.invalid' (from --rdzv-endpoint or --master-addr) did not resolve within " \
        "3 s (--timeout-s)" in run.stderr and 3 <= run.seconds < 20, run.output
    assert "does not resolve yet" in run.stderr, run.output


def test_a_root_host_zeromq_cannot_dial_is_one_line_not_a_hang(tray_env):
    """Node 1 does not resolve the root's host itself (ZeroMQ does, as it dials): a name ZeroMQ refuses outright
    raised from the link's connect with its sockets open, and the head's teardown then waited for them for ever."""
    env = tray_env.env()
    env["TRAY_JOB_TOKEN"] = TOKEN
    try:
        run = tray_env.run(launch_cmd("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "bad host:29500",
                                      "--timeout-s", "3", "--", sys.executable, "-c", "pass"), timeout_s=30, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the head hung")
    assert run.returncode == 2, run.output
    assert "Traceback" not in run.stderr, run.stderr
    assert "'bad host'" in run.stderr and "--rdzv-endpoint" in run.stderr, run.stderr


def test_a_second_node_0_on_the_roots_host_is_told_node_rank_0_may_be_given_twice(tray_env):
    """A second head given --node-rank 0 on the host where node 0's root already listens cannot bind the root's port:
    the error names that cause beside another program on the port, not only a port to change."""
    body = """
    with tray.init() as rank:
        rank.barrier()
    """
    port = free_port()
    first = start_job(tray_env, body, "--timeout-s", "4", nodes=(0,), port=port)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    second = finish(start_job(tray_env, body, "--timeout-s", "4", nodes=(0,), port=port), timeout_s=30)[0]
    finish(first, timeout_s=30)
    assert second.returncode == 2, second.output
    assert f"the root's port {port} is in use on this machine, by another program or the head of another node 0 " \
        "(--node-rank 0 given twice here?)" in second.stderr, second.output


def test_a_slurm_root_port_in_use_is_told_as_the_job_ids_port_not_a_node_rank_given_twice(tray_env):
    """Under Slurm the root's port comes from the job id and the node ranks from SLURM_NODEID: a port in use there is
    another job's step of the same slot, or another program; the advice to give each
    node its own --node-rank misled."""
    from tray.launch.job import slurm_port

    with socket.socket() as squatter:
        for job_id in range(4000 + os.getpid() % 1000, 5000):
            try:
                squatter.bind(("127.0.0.1", slurm_port(str(job_id))))
                break
            except OSError:
                continue
        squatter.listen(8)
        env = tray_env.env()
        env.update({"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0",
                    "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
                    "SLURM_STEP_NUM_NODES": "2", "TRAY_JOB_TOKEN": TOKEN})
        run = tray_env.run(launch_cmd("--slurm", "--timeout-s", "3", "--", sys.executable, "-c", "pass"),
                           timeout_s=30, env=env)
    assert run.returncode == 2, run.output
    assert f"the root's port {slurm_port(str(job_id))} is in use on this machine: under Slurm it comes from the job " \
        "id" in run.stderr, run.output
    assert "--node-rank" not in run.stderr and "--rdzv-endpoint localhost:PORT" in run.stderr, run.output


def test_wrong_token_is_a_clear_error_not_a_hang(tray_env):
    """The head with the wrong token fails at once (its handshake with the root fails, TOKEN_FAILURES times: a
    root that closes while a head connects fails one handshake too) and stops dialling; node 0 waits for the join
    deadline (a failed handshake may be a stranger's), then names the failed handshakes: not one per reconnect
    interval until node 1's ranks had stopped."""
    body = """
    with tray.init() as rank:
        rank.barrier()
    """
    t0 = time.monotonic()
    procs = start_job(tray_env, body, "--timeout-s", "4", tokens=(TOKEN, "another-secret-another-secret"))
    runs = [None, *finish(procs[1:], timeout_s=30)]
    assert time.monotonic() - t0 < 4, runs[1].output  # its own handshake failed: no waiting for a deadline
    runs[0] = finish(procs[:1], timeout_s=30)[0]
    assert time.monotonic() - t0 < 4 + 8, runs[0].output
    assert all(run.returncode != 0 for run in runs), [r.output for r in runs]
    assert "refused this node's CURVE handshake: TRAY_JOB_TOKEN differs" in _root_cause(runs[1]), runs[1].output
    cause = _root_cause(runs[0])
    assert "node(s) 1 did not join" in cause and "failed the CURVE handshake" in cause, runs[0].output
    assert "a head started with another TRAY_JOB_TOKEN?" in cause, runs[0].output
    failed = re.search(r"; (\d+) connections? failed the CURVE handshake", cause)
    assert failed and TOKEN_FAILURES <= int(failed.group(1)) <= TOKEN_FAILURES + 1, cause


def test_a_root_port_another_program_listens_on_is_named_by_the_node_dialling_it(tray_env):
    """Node 1 dials the root's port, where another program accepts TCP connections and says nothing (node 0's head
    fails there: the port is in use): node 1 says its port answered but nothing finished the handshake, not that the
    root could not be reached (not started, a wrong address, a firewall)."""
    port = free_port()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen(8)
        run = finish(start_job(tray_env, "tray.init()\n", "--timeout-s", "3", nodes=(1,), port=port),
                     timeout_s=30)[0]
    assert run.returncode == 3, run.output
    cause = _root_cause(run)
    assert "did not answer within 3 s (--timeout-s): its port accepted a TCP connection" in cause, run.output
    assert "another program listens on that port" in cause, run.output


def test_a_stranger_dialling_the_root_during_the_join_does_not_stop_the_job(tray_env):
    """A head of another job (wrong root key) and an intruder knowing the root's public key (refused by
    ZAP) dial node 0's root before node 1 starts; the job then runs to its end, and the root logs them."""
    body = """
    with tray.init() as rank:
        rank.barrier()
        print(f"rank {rank.rank} done", flush=True)
    """
    import zmq

    from tray.launch.curve import job_keys, make_client

    port = free_port()
    procs = start_job(tray_env, body, nodes=(0,), port=port)
    ctx = zmq.Context()
    strangers = []
    try:
        for knows_root_key in (False, True):
            sock = make_client(ctx, job_keys("another-secret-another-secret"))
            if knows_root_key:
                sock.setsockopt(zmq.CURVE_SERVERKEY, job_keys(TOKEN).server_public)
            sock.setsockopt(zmq.LINGER, 0)
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
            strangers += [sock, monitor]
            sock.connect(f"tcp://127.0.0.1:{port}")
            # the root is reached (and refuses) once node 0 listens: wait for that, bounded
            assert monitor.poll(20_000, zmq.POLLIN), "node 0's root never answered a stranger's handshake"
        procs += start_job(tray_env, body, nodes=(1,), port=port)
        runs = finish(procs, timeout_s=60)
    finally:
        for s in strangers:
            s.close()
        ctx.term()
    for run in runs:
        assert run.returncode == 0, run.output
    for r in range(4):
        assert f"[rank {r}] rank {r} done" in runs[r // 2].stdout, runs[r // 2].output
    logged = [line for line in runs[0].stderr.splitlines() if "failed the CURVE handshake" in line]
    assert logged and all("tray: root: ignored: " in line for line in logged), runs[0].output
    assert len(logged) <= 4, logged  # rate-limited, though the head of another job redials every 100 ms
    assert any("from 127.0.0.1" in line for line in logged), runs[0].output


def test_missing_token_is_a_usage_error(tray_env):
    env = tray_env.env()
    env.pop("TRAY_JOB_TOKEN", None)
    cmd = launch_cmd("--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1", "--", "true")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 2 and "TRAY_JOB_TOKEN" in proc.stderr, proc.stderr


def test_peers_kernel_over_a_spanning_group_is_refused_when_its_program_is_bound(tray_env, tmp_path):
    manifest = tmp_path / "span.json"
    kernel = MANIFESTS / "kernels" / "peer_fill.cu"
    manifest.write_text(f"""{{"format": 1, "name": "span", "vars": {{"words": 64}},
      "groups": [{{"name": "world", "ranks": "all"}}],
      "buffers": [{{"name": "fill", "dtype": "u32", "shape": ["world_size * words"], "export": true}}],
      "kernels": [{{"name": "peer_fill", "source": "{kernel}", "entry": "tray_peer_fill", "peers": true}}],
      "programs": [{{"name": "fill", "ops": [{{"op": "launch", "kernel": "peer_fill", "grid": [1, 1, 1],
        "block": [32, 1, 1], "args": ["peers:fill", "world_size", "rank", "words", 7]}}]}},
        {{"name": "sync", "ops": [{{"op": "barrier", "group": "world"}}]}}]}}""")
    # the manifest launches (its barrier program runs over the spanning group); the peers program is refused
    # when a rank binds it, before any op runs, and every head names it as the job's root cause
    body = """
    with tray.init() as rank:
        rank.run("sync")
        print("sync ran", rank.rank, flush=True)
        rank.run("fill")
    """
    runs = finish(start_job(tray_env, body, "--manifest", str(manifest)), timeout_s=40)
    # the job formed, and a rank ran the barrier program before it bound the peers one
    assert all("every node is ready" in run.stderr for run in runs), runs[0].output
    assert any("sync ran" in run.output for run in runs), runs[0].output
    for run in runs:
        assert run.returncode != 0, run.output
        cause = _root_cause(run)
        assert "ManifestError" in cause, run.output
        assert "group 'world' spans nodes" in run.stderr and "peer_fill" in run.stderr, run.output


def staged_fill_manifest(path, kernel) -> str:
    """A manifest whose program `fill` runs peer_fill over world with its table staged for the other nodes,
    then an alltoall across nodes and a barrier; written to `path`."""
    path.write_text(f"""{{"format": 1, "name": "staged", "vars": {{"words": 64}},
      "groups": [{{"name": "world", "ranks": "all"}}],
      "buffers": [{{"name": "fill", "dtype": "u32", "shape": ["world_size * words"], "export": true}},
                  {{"name": "stage", "dtype": "u32", "shape": ["world_size * words"]}}],
      "kernels": [{{"name": "peer_fill", "source": "{kernel}", "entry": "tray_peer_fill", "peers": true}}],
      "programs": [{{"name": "fill", "ops": [
        {{"op": "launch", "kernel": "peer_fill", "grid": [2, 1, 1], "block": [32, 1, 1],
          "args": ["peers:fill", "world_size", "rank", "words", 7],
          "stage": {{"fill": {{"buffer": "stage", "block": "words * 4"}}}}}},
        {{"op": "nccl", "collective": "alltoall", "group": "world", "send": "stage", "recv": "fill",
          "count": "words", "dtype": "u32", "across": "nodes"}},
        {{"op": "barrier", "group": "world"}}]}}]}}""")
    return str(path)


# every rank: run the staged program twice; its buffer holds every writer's pattern, and its staging
# buffer the blocks of the other nodes' members only (this node's were written through the mappings)
STAGED_BODY = """
    words = 64
    def pattern(writer, owner):
        return ((7 * 0x9E3779B1) & 0xFFFFFFFF) ^ (writer << 24) ^ (owner << 16) ^ np.arange(words, dtype=np.uint32)
    with tray.init() as rank:
        me, n, per = rank.rank, rank.world_size, int(os.environ["LOCAL_WORLD_SIZE"])
        rank.write("fill", np.zeros(n * words, np.uint32))
        rank.write("stage", np.zeros(n * words, np.uint32))
        rank.barrier()
        for _ in range(2):                                  # the plan (and its staged table) replayed
            rank.run("fill")
        rank.synchronize()
        fill = rank.read("fill").reshape(n, words)
        for s in range(n):                                  # slot s: writer s's pattern for this rank
            assert np.array_equal(fill[s], pattern(s, me).astype(np.uint32)), (s, fill[s][:4])
        stage = rank.read("stage").reshape(n, words)
        for g in range(n):
            want = pattern(me, g).astype(np.uint32) if g // per != me // per else np.zeros(words, np.uint32)
            assert np.array_equal(stage[g], want), (g, stage[g][:4])
        print("staged ok", me, flush=True)
    """


def test_a_staged_peers_kernel_spans_nodes(tray_env, tmp_path):
    manifest = staged_fill_manifest(tmp_path / "staged.json", MANIFESTS / "kernels" / "peer_fill.cu")
    runs = finish(start_job(tray_env, STAGED_BODY, "--manifest", manifest), timeout_s=40)
    for node, run in enumerate(runs):
        assert run.returncode == 0, run.output
        for r in (2 * node, 2 * node + 1):
            assert f"[rank {r}] staged ok {r}" in run.stdout, run.output


def test_ep_moe_bench_across_two_nodes_equals_ep1(tray_env, tmp_path):
    out = tmp_path / "ep.json"
    run = tray_env.run([sys.executable, "-m", "tray", "bench", "ep-moe", "-n", "4", "--nnodes", "2",
                        "--backend", "host", "--hidden", "256", "--experts", "16", "--topk", "4",
                        "--expert-dim", "256", "--tokens", "16", "--routing", "uniform", "--repeats", "1",
                        "--json", str(out)], timeout_s=120)
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    assert report["nnodes"] == 2 and "staged" in report["cross_node_path"] and report["passed"], report
    assert report["ranks_nnodes"] == [2], report        # every EP-N rank ran in a job of two nodes
    (r,) = report["runs"]
    c = r["checks"]
    # the peer path (staged between the nodes) and the NCCL path, each row equal to EP1's
    assert c["rows"] == 64 and c["peer_rows_differ_from_ep1"] == 0 and c["nccl_rows_differ_from_ep1"] == 0, c
    assert c["nan_rows"] == 0 and c["layout_reports_ok"] and c["after_replay_equal"], c
    assert set(r["us"]) == {"peer", "nccl", "ep1"} and "dispatch_ll" not in r["us"]["peer"], r["us"]
    assert all(v > 0 for p in ("peer", "nccl") for v in r["us"][p].values()), r["us"]
    assert "2 nodes (2 per node)" in run.stdout and "PASSED" in run.stdout, run.output


def test_nodes_with_different_rank_counts_are_refused_by_name(tray_env):
    body = """
    with tray.init() as rank:
        rank.barrier()
    """
    runs = finish(start_job(tray_env, body, node_args={1: ("-n", "1")}), timeout_s=40)
    assert all(run.returncode == 3 for run in runs), [r.output for r in runs]
    for run in runs:
        assert "1 rank per node, node 0 runs 2" in _root_cause(run), run.output
    # node 1 was told at its refusal: node 0 does not wait for it to join (LATE_TELL_S, 5 s)
    assert "not joined yet" not in runs[0].stderr and runs[0].seconds < 8, runs[0].output


def test_nodes_launched_with_different_vars_are_refused_naming_them(tray_env):
    """The manifest's digest does not cover --var: node 1 with other vars formed a job whose buffers differed
    between nodes, found later (if at all) as a program's mismatch. The root now refuses node 1, naming the vars."""
    body = """
    with tray.init() as rank:
        rank.barrier()
    """
    runs = finish(start_job(tray_env, body, "--manifest", FILL, "--var", "count=64",
                            node_args={1: ("--var", "count=128")}), timeout_s=40)
    assert all(run.returncode == 3 for run in runs), [r.output for r in runs]
    assert "--var count=128, node 0 has --var count=64; launch every node with the same --var values" in \
        _root_cause(runs[1]), runs[1].output


def test_a_node_of_another_rendezvous_id_is_named_when_the_join_times_out(tray_env):
    """Node 1 started with another --rdzv-id is refused (it may be another job's head sharing the endpoint and token),
    and when the join times out the root says so of node 1, not that it was not started or could not reach it."""
    body = """
    with tray.init() as rank:
        rank.barrier()
    """
    runs = finish(start_job(tray_env, body, "--timeout-s", "3", node_args={1: ("--rdzv-id", "other")}), timeout_s=30)
    assert all(run.returncode == 3 for run in runs), [r.output for r in runs]
    cause = _root_cause(runs[0])
    assert "node(s) 1 did not join the root" in cause and "not started" not in cause, runs[0].output
    assert "refused: node 1 (" in cause and "rendezvous id 'other', the root's is 'test'" in cause, runs[0].output


def test_a_node_rank_given_twice_is_refused_by_name(tray_env):
    body = """
    with tray.init() as rank:
        rank.barrier()
    """
    runs = finish(start_job(tray_env, body, nnodes=3, node_args={2: ("--node-rank", "1")}), timeout_s=40)
    assert all(run.returncode == 3 for run in runs), [r.output for r in runs]
    assert "node rank 1 joined twice" in _root_cause(runs[0]), runs[0].output


@pytest.mark.parametrize("dropped", [3, 2, 1])
def test_a_barrier_over_a_spanning_group_names_who_is_missing(tray_env, dropped):
    """The hierarchical barrier with one rank out: a member of another node (3), a node's leader (2: named
    by the root in the leaders' step, and by its own node's member), a member of the root's node (1)."""
    body = f"""
    with tray.init() as rank:
        assert rank.barrier_of("world").path == "hierarchical"
        rank.barrier()
        if rank.rank != {dropped}:
            t = time.monotonic()
            try:
                rank.barrier(timeout_s=0.5)
            except tray.BarrierTimeout as exc:
                print("missing", exc.missing, round(time.monotonic() - t, 2), flush=True)
        else:
            time.sleep(2.5)
    """
    runs = finish(start_job(tray_env, body))
    assert all(run.returncode == 0 for run in runs), [r.output for r in runs]
    for r in sorted({0, 1, 2, 3} - {dropped}):
        found = re.search(rf"\[rank {r}\] missing \[{dropped}\] ([0-9.]+)", runs[r // 2].stdout)
        assert found, runs[r // 2].output
        # the local wait (0.5 s), the leaders' step bounded at twice that, and the 2-core box's slack
        assert float(found.group(1)) < 2.5, runs[r // 2].output


def test_a_spanning_barrier_missing_ranks_on_both_nodes_names_them_all_with_the_time_it_waited(tray_env):
    """Ranks 1, 2 and 3 stay away: rank 0's local stage times out (rank 1), then its leaders' step waits for node
    1's leader (rank 2) in vain. Before, it said it waited 0.5 s for rank 1 alone, after about 1.5 s."""
    body = """
    with tray.init() as rank:
        rank.barrier()
        if rank.rank == 0:
            t = time.monotonic()
            try:
                rank.barrier(timeout_s=0.5)
            except tray.BarrierTimeout as exc:
                print("missing", exc.missing, round(exc.waited_s, 2), round(time.monotonic() - t, 2), flush=True)
        else:
            time.sleep(3)
    """
    runs = finish(start_job(tray_env, body))
    assert all(run.returncode == 0 for run in runs), [r.output for r in runs]
    found = re.search(r"\[rank 0\] missing \[1, 2\] ([0-9.]+) ([0-9.]+)", runs[0].stdout)
    assert found, runs[0].output
    said, took = float(found.group(1)), float(found.group(2))
    assert 1.0 < said <= took < 3.0, runs[0].output   # the local 0.5 s, then the leaders' step (bounded at 1 s)


@pytest.mark.parametrize("leaves", ["exit", "close"])
def test_ranks_that_end_on_one_node_while_another_waits_in_a_step_are_named_at_once(tray_env, leaves):
    """Ranks 0 and 1 (node 0) end while ranks 2 and 3 (node 1) wait in an exchange they never join: node 0's head
    tells the root, which stops the job naming them, instead of the exchange's 20 s timing out (rank 3 votes a
    second after rank 2: node 1's votes go on to the root together)."""
    end = "sys.exit(0)" if leaves == "exit" else "rank.close(); time.sleep(30)"
    body = f"""
    rank = tray.init()
    rank.barrier()
    if rank.rank < 2:
        {end}
    if rank.rank == 3:
        time.sleep(1)
    rank.exchange("early", rank.rank, timeout_s=20)   # ranks 2 and 3 only: node 1's step
    """
    runs = finish(start_job(tray_env, body), timeout_s=60)
    how = "exited with code 0" if leaves == "exit" else "closed its tray"
    for run in runs:
        assert run.returncode == 1, run.output
        cause = _root_cause(run)
        # rank 2's vote, held at its head 0.1 s, is told the root before rank 3's comes
        assert re.search(rf"rank [01] {how}.* while (rank 2 waits|ranks 2,3 wait) for it in exchange 'early' "
                         r"\(round 1\)",
                         cause), run.output
        assert run.seconds < 15, run.output


@pytest.mark.parametrize("case", ["pairs", "kind", "range"])
def test_relayed_collectives_pair_and_check_like_one_hosts(tray_env, case):
    """The host backend's collectives of a group spanning nodes (relayed through the root): a sendrecv is a step
    of its pair alone (it was a gather of the whole group, so members that made none failed it), and calls that
    differ or run past their buffers fail naming it (they passed silently, or crashed in numpy)."""
    body = {
        "pairs": """
    with tray.init() as rank:
        c = rank.collectives("world")
        s, r = rank.buffer("send"), rank.buffer("recv")
        if rank.rank in (0, 2):   # across the nodes; ranks 1 and 3 make none
            rank.write("send", np.full(s.shape, rank.rank, np.float32))
            c.sendrecv(s.ptr, r.ptr, 16, "f32", 2 - rank.rank)
            print("got", rank.rank, int(rank.read("recv")[0]), flush=True)
        rank.barrier(timeout_s=30)
    """,
        "kind": """
    with tray.init() as rank:
        c = rank.collectives("world")
        s, r = rank.buffer("send"), rank.buffer("recv")
        getattr(c, "allgather" if rank.rank == 2 else "allreduce")(s.ptr, r.ptr, 16, "f32")
    """,
        "range": """
    with tray.init() as rank:
        c = rank.collectives("world")
        s, r = rank.buffer("send"), rank.buffer("recv")
        c.allgather(s.ptr, r.ptr, s.shape[0], "f32")   # the receive buffer holds a quarter of that
    """}[case]
    runs = finish(start_job(tray_env, body, "--manifest", FILL, "--var", "count=16"), timeout_s=60)
    if case == "pairs":
        assert all(run.returncode == 0 for run in runs), [r.output for r in runs]
        assert "got 0 2" in runs[0].stdout and "got 2 0" in runs[1].stdout, [r.output for r in runs]
        return
    assert all(run.returncode != 0 for run in runs), [r.output for r in runs]
    cause = _root_cause(runs[0])
    want = ("its members called different collectives: rank 0: allreduce of 16 f32; rank 1: allreduce of 16 f32; "
            "rank 2: allgather of 16 f32" if case == "kind" else
            "allgather of 64 f32 over group 'world': its receive range reaches 1024 B")
    assert want in cause, [r.output for r in runs]


def test_a_group_with_instances_spanning_nodes_and_within_one_runs_its_collectives(tray_env, tmp_path):
    """Two nodes of 3 ranks, a group of pairs: (0,1) and (4,5) within a node, (2,3) across. The spanning pair's
    collectives are relayed and needed no join, so its members never made the tray-wide join step the others
    waited in; every rank makes it now."""
    manifest = tmp_path / "duo.json"
    manifest.write_text(json.dumps({
        "format": 1, "name": "duo", "groups": [{"name": "duo", "size": 2}],
        "buffers": [{"name": "x", "dtype": "f32", "shape": [4], "export": True, "group": "duo"},
                    {"name": "y", "dtype": "f32", "shape": [4]}],
        "programs": [{"name": "sum", "ops": [{"op": "barrier", "group": "duo"},
                                             {"op": "nccl", "collective": "allreduce", "group": "duo", "send": "x",
                                              "recv": "y", "count": 4, "dtype": "f32"}]}]}))
    body = """
    with tray.init() as rank:
        rank.write("x", np.full(4, rank.rank, np.float32))
        rank.run("sum")
        print("sum", rank.rank, int(rank.read("y")[0]), flush=True)
        rank.barrier(timeout_s=30)
    """
    runs = finish(start_job(tray_env, body, "-n", "3", "--manifest", str(manifest)), timeout_s=60)
    assert all(run.returncode == 0 for run in runs), [r.output for r in runs]
    out = runs[0].stdout + runs[1].stdout
    for r, total in ((0, 1), (1, 1), (2, 5), (3, 5), (4, 9), (5, 9)):
        assert f"sum {r} {total}" in out, out


def test_node_0_must_run_where_the_endpoint_points(tray_env):
    env = tray_env.env()
    env["TRAY_JOB_TOKEN"] = TOKEN
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never an address of this machine
    cmd = launch_cmd("--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "192.0.2.7:29400", "--", "true")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env, cwd=str(tray_env.tmp))
    assert proc.returncode == 2, proc.stderr
    assert "node 0 cannot listen on tcp://192.0.2.7:29400" in proc.stderr, proc.stderr


def test_a_gloo_program_spans_the_nodes_through_torchruns_variables(tray_env):
    pytest.importorskip("torch", reason="torch (CPU) is installed by `make test`; this run has none")
    body = """
    import torch
    import torch.distributed as dist
    assert os.environ["GROUP_WORLD_SIZE"] == "2" and os.environ["WORLD_SIZE"] == "2"
    dist.init_process_group("gloo")                       # env://: MASTER_ADDR/PORT name node 0
    with tray.init() as rank:
        assert dist.get_rank() == rank.rank and os.environ["GROUP_RANK"] == str(rank.rank)
        t = torch.full((4,), float(rank.rank + 1))
        dist.all_reduce(t)
        assert t.tolist() == [3.0] * 4, t
        rank.barrier()
        print("gloo across nodes ok", rank.rank)
    dist.destroy_process_group()
    """
    runs = finish(start_job(tray_env, body, node_args={0: ("-n", "1"), 1: ("-n", "1")}), timeout_s=120)
    for node, run in enumerate(runs):
        assert run.returncode == 0, run.output
        assert f"gloo across nodes ok {node}" in run.stdout, run.output


@pytest.mark.parametrize("stranger", ["other_job", "node_rank_again"])
def test_a_head_that_cannot_join_a_running_job_is_refused_alone(tray_env, stranger):
    """Same endpoint and token, the job already up: a head of another job (--rdzv-id) or a second node 1 is refused
    by name, and the job runs to its end (before, both of its heads failed with exit 3)."""
    body = """
    with tray.init() as rank:
        rank.barrier()
        open(f"up-{rank.rank}", "w").close()
        time.sleep(4)
        rank.barrier()
        print(f"rank {rank.rank} done", flush=True)
    """
    port = free_port()
    procs = start_job(tray_env, body, port=port)
    try:
        deadline = time.monotonic() + 30
        while not all((tray_env.tmp / f"up-{r}").exists() for r in range(4)) and time.monotonic() < deadline:
            time.sleep(0.05)
        args = ("--rdzv-id", "other") if stranger == "other_job" else ()
        late = start_job(tray_env, body, nodes=(1,), port=port, node_args={1: args})
        late_run = finish(late, timeout_s=30)[0]
    finally:
        runs = finish(procs, timeout_s=60)
    assert late_run.returncode == 3, late_run.output
    why = "rendezvous id 'other', the root's is 'test'" if stranger == "other_job" else "node rank 1 joined twice"
    assert "cannot join this job" in late_run.stderr and why in late_run.stderr, late_run.stderr
    for run in runs:
        assert run.returncode == 0, run.output
    assert "tray: root: refused node 1" in runs[0].stderr and why in runs[0].stderr, runs[0].stderr


def test_an_exchange_a_rank_on_another_node_never_makes_is_placed_by_the_root(tray_env):
    """Rank 3 (node 1) never reaches the exchange the others wait in: the root hears node 1's votes only once all
    its ranks voted, so node 0's output never named who was missing. The root names who it has not heard from in
    the job's stop, and every head prints it."""
    body = """
    with tray.init() as rank:
        if rank.rank == 3:
            time.sleep(60)
        rank.exchange("it", rank.rank, timeout_s=2.0)
    """
    runs = finish(start_job(tray_env, body), timeout_s=40)
    assert all(run.returncode != 0 for run in runs), [r.output for r in runs]
    for run in runs:  # rank 2's vote, held at its head, was told the root: every head names rank 3 alone
        assert "tray-wide step: exchange 'it' (round 1) was still waiting for rank 3 (node 1)" in run.stderr, \
            run.output
        # in the verdict's first line too: the rank that gave up reports the wait, the root says whom it was for
        assert _root_cause(run).endswith("; the step waited for rank 3 (node 1)"), run.output


def test_a_step_a_rank_gave_up_is_not_held_against_a_rank_that_leaves(tray_env):
    """Across nodes too: rank 0 gives exchange 'a' up (a caught 2 s timeout) and goes on; rank 1 never joins 'a'
    and ends. Counting rank 0 as still waiting there, the root stopped the job naming rank 1."""
    body = """
    with tray.init() as rank:
        if rank.rank == 0:
            try:
                rank.exchange("a", 0, timeout_s=2.0)
            except tray.HandshakeError:
                print("gave a up", flush=True)
            time.sleep(1.5)
        else:
            time.sleep(3.0)
        print("done", rank.rank, flush=True)
    """
    runs = finish(start_job(tray_env, body, "-n", "1"), timeout_s=60)
    assert all(run.returncode == 0 for run in runs), [r.output for r in runs]
    assert "gave a up" in runs[0].stdout and "done 1" in runs[1].stdout


def test_a_late_vote_on_a_relayed_step_the_root_gave_up_waits_for_nothing(tray_env):
    """A relayed allreduce over the world: rank 2 comes 4 s late, the others time out (caught) and go on to an
    exchange. Rank 2's late vote reopened the expired step on node 1, whose crossed-steps check then saw rank 3
    (in the exchange) and rank 2 (in the step) wait for each other, and stopped the job; the root answers such a
    vote at once, so it waits for nothing."""
    body = """
    from tray.errors import BarrierTimeout
    with tray.init() as rank:
        c = rank.collectives("world")
        s, r = rank.buffer("send"), rank.buffer("recv")
        if rank.rank == 2:
            time.sleep(4)
        try:
            c.allreduce(s.ptr, r.ptr, 16, "f32")
        except BarrierTimeout as exc:
            print("caught", rank.rank, exc, flush=True)
        print("x", rank.rank, rank.exchange("x", rank.rank), flush=True)
    """
    runs = finish(start_job(tray_env, body, "--manifest", FILL, "--var", "count=16"), timeout_s=60)
    assert all(run.returncode == 0 for run in runs), [r.output for r in runs]
    assert "x 2 [0, 1, 2, 3]" in runs[1].stdout, runs[1].output
    late = next(line for line in runs[1].stdout.splitlines() if "caught 2 " in line)
    assert "(this rank came after the others had waited that long for it and gone on: it was late)" in late, late


def test_ranks_of_two_nodes_waiting_in_different_steps_are_named_at_once(tray_env):
    """Node 0's ranks wait in exchange 'a', node 1's in 'b': each head sees its own ranks agree, so neither saw a
    deadlock and every rank waited its timeout. The root sees both steps and names the cycle as its last vote
    comes; every head prints it."""
    body = """
    with tray.init() as rank:
        rank.barrier()
        rank.exchange("a" if rank.rank < 2 else "b", rank.rank, timeout_s=40.0)
    """
    runs = finish(start_job(tray_env, body), timeout_s=60)
    assert all(run.returncode == 1 for run in runs), [r.output for r in runs]
    for run in runs:
        assert "across nodes 0,1: the ranks wait in steps that wait for one another, so none can ever end:" in \
            run.stderr, run.stderr
        assert re.search(r"exchange '([ab])' \(round 1\) waits for rank \d, which waits in exchange '(?!\1)[ab]' "
                         r"\(round 1\)", run.stderr), run.stderr
        assert run.seconds < 20, run.output


def cross_manifest(tmp_path) -> str:
    """A group of two instances spanning the two nodes of two: (0, 2) and (1, 3); buffers send/recv f32[16]."""
    manifest = tmp_path / "cross.json"
    manifest.write_text(json.dumps({
        "format": 1, "name": "cross", "barrier_timeout_s": 30, "groups": [{"name": "cross", "ranks": [[0, 2], [1, 3]]}],
        "buffers": [{"name": "send", "dtype": "f32", "shape": [16]}, {"name": "recv", "dtype": "f32", "shape": [16]}]}))
    return str(manifest)


def test_a_group_step_crossing_a_tray_wide_step_across_nodes_is_named(tray_env, tmp_path):
    """Rank 0 (node 0) calls an allreduce over its pair (0, 2), relayed through the root as a step of the pair; rank 2
    (node 1) waits with the other ranks in exchange 'x': the pair's step waits for rank 2, the exchange for rank 0.
    Neither head sees a cycle among its own ranks."""
    manifest = cross_manifest(tmp_path)
    body = """
    with tray.init() as rank:
        c = rank.collectives("cross")   # every rank: the groups' join made
        rank.barrier()
        if rank.rank == 0:
            s, r = rank.buffer("send"), rank.buffer("recv")
            c.allreduce(s.ptr, r.ptr, 16, "f32")
        rank.exchange("x", rank.rank, timeout_s=40.0)
    """
    runs = finish(start_job(tray_env, body, "--manifest", manifest), timeout_s=60)
    assert all(run.returncode == 1 for run in runs), [r.output for r in runs]
    for run in runs:
        assert "across nodes 0,1: the ranks wait in steps that wait for one another" in run.stderr, run.stderr
        assert "exchange 'x' (round 1) waits for rank 0, which waits in the gather step of group 'cross' " in \
            run.stderr, run.stderr
        assert run.seconds < 20, run.output


def test_a_step_a_node_gave_up_is_not_taken_for_a_cycle_across_nodes(tray_env):
    """Node 0's ranks give exchange 'a' up (a caught 2 s timeout) and go on to 'b' after a while; node 1's ranks make
    'b' in that while. Node 0's votes in 'a' still at the root, counted as waiting, would make 'a' and 'b' a false
    cycle."""
    body = """
    with tray.init() as rank:
        if rank.rank < 2:
            try:
                rank.exchange("a", rank.rank, timeout_s=2.0)
            except tray.HandshakeError:
                print("gave a up", rank.rank, flush=True)
            time.sleep(2.0)   # node 1's ranks are in 'b' meanwhile
        else:
            time.sleep(3.0)
        assert rank.exchange("b", rank.rank, timeout_s=20.0) == [0, 1, 2, 3]
        print("done", rank.rank, flush=True)
    """
    runs = finish(start_job(tray_env, body), timeout_s=60)
    assert all(run.returncode == 0 for run in runs), [r.output for r in runs]
    assert runs[0].stdout.count("gave a up") == 2 and runs[1].stdout.count("done") == 2, [r.output for r in runs]


def test_a_cycle_through_votes_held_at_both_heads_is_named(tray_env, tmp_path):
    """Ranks 0 and 3 make an allreduce over their pair first, ranks 1 and 2 exchange 'x' first: each head holds its
    rank's vote in 'x' (its other rank is not there), so the root heard of no vote in 'x' and each head sees a step
    of a pair waiting for a rank of the other node. The heads tell the root of votes held a while."""
    body = """
    with tray.init() as rank:
        c = rank.collectives("cross")
        s, r = rank.buffer("send"), rank.buffer("recv")
        rank.barrier()
        if rank.rank in (0, 3):
            c.allreduce(s.ptr, r.ptr, 16, "f32")
        rank.exchange("x", rank.rank, timeout_s=40.0)
        if rank.rank in (1, 2):
            c.allreduce(s.ptr, r.ptr, 16, "f32")
    """
    runs = finish(start_job(tray_env, body, "--manifest", cross_manifest(tmp_path)), timeout_s=60)
    assert all(run.returncode == 1 for run in runs), [r.output for r in runs]
    for run in runs:
        assert "across nodes 0,1: the ranks wait in steps that wait for one another" in run.stderr, run.stderr
        assert re.search(r"exchange 'x' \(round 1\) waits for rank [03], which waits in the gather step of group "
                         r"'cross'", run.stderr), run.stderr
        assert run.seconds < 20, run.output


def test_a_vote_held_at_a_head_after_its_rank_gave_the_step_up_is_no_cycle(tray_env, tmp_path):
    """Rank 0 gives exchange 's1' up (a caught 1 s timeout) and goes on to an allreduce over its pair (0, 2); its
    node-mate rank 1 comes to 's1' 3 s late, which decides it. Rank 0's vote in 's1' was held at its head, so the
    root, hearing of rank 0 only in the pair's step, took 's1' for waiting for rank 0: a false cycle."""
    body = """
    with tray.init() as rank:
        c = rank.collectives("cross")
        s, r = rank.buffer("send"), rank.buffer("recv")
        rank.barrier()
        if rank.rank == 1:
            time.sleep(3.0)
        try:
            rank.exchange("s1", rank.rank, timeout_s=1.0 if rank.rank == 0 else 30.0)
        except tray.HandshakeError:
            print("gave s1 up", rank.rank, flush=True)
        c.allreduce(s.ptr, r.ptr, 16, "f32")
        print("ok", rank.rank, flush=True)
    """
    runs = finish(start_job(tray_env, body, "--manifest", cross_manifest(tmp_path)), timeout_s=60)
    assert all(run.returncode == 0 for run in runs), [r.output for r in runs]
    assert "gave s1 up 0" in runs[0].stdout, runs[0].output
    assert runs[0].stdout.count("ok ") + runs[1].stdout.count("ok ") == 4, [r.output for r in runs]


def test_a_cycle_after_a_step_the_ranks_gave_up_is_named(tray_env):
    """Node 0's ranks give exchange 'a' up (a caught 1 s timeout) and wait in 'b'; node 1's wait in 'c'. Their
    stale votes in 'a' made ranks 0 and 1 free for good (a rank in two steps), so the cycle of 'b' and 'c' was
    never named, only each rank's timeout."""
    body = """
    with tray.init() as rank:
        rank.barrier()
        if rank.rank < 2:
            try:
                rank.exchange("a", rank.rank, timeout_s=1.0)
            except tray.HandshakeError:
                pass
        else:
            time.sleep(2.0)
        rank.exchange("b" if rank.rank < 2 else "c", rank.rank, timeout_s=40.0)
    """
    runs = finish(start_job(tray_env, body), timeout_s=60)
    assert all(run.returncode == 1 for run in runs), [r.output for r in runs]
    for run in runs:
        assert "across nodes 0,1: the ranks wait in steps that wait for one another" in run.stderr, run.stderr
        assert run.seconds < 20, run.output


@pytest.mark.parametrize("late_s", [0.0, 2.0])
def test_a_node_joining_after_the_job_failed_hears_the_root_cause(tray_env, late_s):
    """Node 0's rank 0 exits 1 before tray.init() while node 1 is still starting (or starts 2 s later): node 1
    said the root refused its token (the root closed during its handshake), or waited out --timeout-s and said it
    could not reach the root. Node 0's root now stays up a while to tell late nodes the root cause."""
    body = """
    if os.environ["RANK"] == "0":
        sys.exit(1)
    with tray.init() as rank:
        rank.barrier()
    """
    port = free_port()
    procs = start_job(tray_env, body, "--timeout-s", "20", nodes=(0,), port=port)
    time.sleep(late_s)
    procs += start_job(tray_env, body, "--timeout-s", "20", nodes=(1,), port=port)
    runs = finish(procs, timeout_s=60)
    assert all(run.returncode == 1 for run in runs), [r.output for r in runs]
    for run in runs:
        cause = _root_cause(run)
        assert "rank 0" in cause and "exit" in cause, [r.output for r in runs]
        assert "TRAY_JOB_TOKEN" not in run.stderr and "could not reach" not in run.stderr, run.output
    assert runs[1].seconds < 10, runs[1].output


def test_a_node_none_of_whose_ranks_voted_names_its_missing_rank(tray_env):
    """Three nodes of one rank: rank 1 never reaches the exchange. Its head had no vote of the step, so it named
    nobody; every head now prints the root's view with the job's stop."""
    body = """
    with tray.init() as rank:
        rank.barrier()
        if rank.rank == 1:
            time.sleep(60)
        rank.exchange("t", rank.rank, timeout_s=2.0)
    """
    runs = finish(start_job(tray_env, body, "-n", "1", nnodes=3), timeout_s=40)
    assert all(run.returncode != 0 for run in runs), [r.output for r in runs]
    for run in runs:
        assert "tray-wide step: exchange 't' (round 1) was still waiting for rank 1 (node 1)" in run.stderr, \
            run.output


def test_ranks_that_end_while_a_vote_waits_held_at_another_head_are_named_at_once(tray_env):
    """Ranks 0 and 1 (node 0) exit while rank 2 waits in an exchange and rank 3, its node-mate, is busy elsewhere:
    node 1's head held rank 2's vote, so the root saw no step and waited for rank 2's 20 s timeout."""
    body = """
    rank = tray.init()
    rank.barrier()
    if rank.rank < 2:
        sys.exit(0)
    if rank.rank == 3:
        time.sleep(30)
    rank.exchange("early", rank.rank, timeout_s=20)
    """
    runs = finish(start_job(tray_env, body), timeout_s=60)
    for run in runs:
        assert run.returncode == 1, run.output
        assert re.search(r"rank [01] exited with code 0.* while rank 2 waits for it in exchange 'early' \(round 1\)",
                         _root_cause(run)), run.output
        assert run.seconds < 15, run.output


def test_a_vote_held_a_moment_at_its_head_is_not_named_missing_by_that_head(tray_env):
    """Rank 0 fails 50 ms after ranks 1 and 2 voted in exchange 't' (rank 3 never does): rank 2's vote was still held
    at node 1's head, not yet told the root, and the stop's account named rank 2 missing. Each head corrects its own
    ranks."""
    body = """
    with tray.init() as rank:
        rank.barrier(timeout_s=30)
        if rank.rank == 3:
            time.sleep(60)
        if rank.rank == 0:
            time.sleep(0.05)
            raise ValueError("rank zero fails")
        rank.exchange("t", rank.rank, timeout_s=30)
    """
    runs = finish(start_job(tray_env, body), timeout_s=60)
    assert all(run.returncode == 1 for run in runs), [r.output for r in runs]
    assert "rank zero fails" in _root_cause(runs[1]), runs[1].output
    line = next(x for x in runs[1].stderr.splitlines() if "exchange 't' (round 1) was still waiting for" in x)
    assert line.endswith("was still waiting for rank 0 (node 0), rank 3 (node 1)"), runs[1].output


def test_the_node_a_wait_failed_on_says_what_its_missed_rank_is_doing(tray_env):
    """Rank 1 gives up waiting for rank 0, which sleeps elsewhere, both on node 0: node 0's head says under the job's
    verdict what rank 0 is doing (its stack went to node 0's output); those notes were made, then dropped when the
    root's stop replaced the node's failure. The other node prints the verdict without them."""
    body = """
    with tray.init() as rank:
        rank.barrier()
        if rank.rank == 0:
            time.sleep(30)
        rank.barrier("pairs", timeout_s=1)
    """
    runs = finish(start_job(tray_env, body, "--manifest", str(MANIFESTS / "peer_fill.json")))
    assert all(run.returncode != 0 for run in runs), [r.output for r in runs]
    causes = [_root_cause(run) for run in runs]
    assert causes[0] == causes[1] and "rank 1 waited" in causes[0] and "for rank 0" in causes[0], causes
    node0 = runs[0].stderr.split(causes[0], 1)[1].splitlines()[1:]
    assert node0 and node0[0].startswith("tray:   rank 0 is alive") and "running but not where the others wait" \
        in node0[0], runs[0].stderr
    assert "rank 0 is alive" not in runs[1].stderr, runs[1].stderr


def test_a_rank_another_nodes_wait_missed_is_said_by_its_own_node(tray_env):
    """Two nodes of one rank: rank 0 (node 0) stopped, rank 1's barrier on node 1 times out naming it. Node 0's head,
    the only one that knows rank 0, adds what it sees of it (alive, no heartbeat, no CPU: stopped) to the job's root
    cause, as the head of one host does for its own ranks; node 1's head has nothing to add."""
    body = """
    import signal
    with tray.init() as rank:
        rank.barrier()
        if rank.rank == 0:
            os.kill(os.getpid(), signal.SIGSTOP)
        rank.barrier(timeout_s=1.5)
    """
    runs = finish(start_job(tray_env, body, "-n", "1", "--heartbeat-timeout-s", "30"), timeout_s=60)
    for run in runs:
        assert run.returncode == 1, run.output
        cause = _root_cause(run)
        assert "node 1, rank 1 reported BarrierTimeout" in cause and "for rank 0" in cause, run.output
    assert re.search(r"^tray:   node 0: rank 0 is alive, last heartbeat .* (stopped|frozen)", runs[0].stderr, re.M), \
        runs[0].stderr
    assert "node 0: rank 0" not in runs[1].stderr, runs[1].stderr


def test_a_spanning_barrier_whose_nodes_wait_unequally_names_the_member_a_leader_waits_for(tray_env):
    """Rank 3 (node 1) stays away; node 0 waits 0.5 s, node 1 3 s: node 0's leaders' step gives up on node 1's
    leader (rank 2) while it still waits for rank 3. Node 0 names rank 2 and says it leads rank 3 (it said rank 2
    died or never entered); rank 2 names rank 3 alone (it named itself too, as late)."""
    body = """
    with tray.init() as rank:
        rank.barrier()
        if rank.rank != 3:
            try:
                rank.barrier(timeout_s=0.5 if rank.rank < 2 else 3.0)
            except tray.BarrierTimeout as exc:
                print("missing", exc.missing, "|", exc, flush=True)
        else:
            time.sleep(4.5)
    """
    runs = finish(start_job(tray_env, body))
    assert all(run.returncode == 0 for run in runs), [r.output for r in runs]
    for r in (0, 1):
        said = re.search(rf"\[rank {r}\] missing \[2\] \| (.*)", runs[0].stdout)
        assert said and "rank 2 leads ranks 2,3 on its node" in said.group(1), runs[0].output
        assert "longer than this rank's 0.5 s" in said.group(1), runs[0].output
    said = re.search(r"\[rank 2\] missing \[3\] \| (.*)", runs[1].stdout)
    assert said and "rank 3 missing" in said.group(1), runs[1].output


def test_master_port_is_held_on_node_0_and_one_already_taken_is_said(tray_env):
    """MASTER_PORT (the root's port + 1) is held by node 0's head while the job runs (nothing else takes it from a
    program's torch.distributed store); one another program listens on is said in one line, not refused."""
    body = """
    import socket
    with tray.init() as rank:
        if rank.rank == 0:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
                print("MASTER_PORT was free to take", flush=True)
            except OSError:
                print("MASTER_PORT held", flush=True)
            s.close()
    """
    runs = finish(start_job(tray_env, body, "-n", "1"), timeout_s=60)
    assert all(run.returncode == 0 for run in runs), [r.output for r in runs]
    assert "MASTER_PORT held" in runs[0].stdout, runs[0].output
    # NOTE: a free port whose next one is free too: another test's process may hold port + 1 (files run side by side)
    for _ in range(50):
        port = free_port()
        taken = socket.socket()
        try:
            taken.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            taken.close()
    else:
        pytest.fail("no free port with a free next one in 50 tries")
    with taken:
        taken.listen()
        runs = finish(start_job(tray_env, body, "-n", "1", port=port), timeout_s=60)
    assert all(run.returncode == 0 for run in runs), [r.output for r in runs]
    assert f"MASTER_PORT {port + 1} (the root's port + 1) is taken on 127.0.0.1" in runs[0].stderr, runs[0].output
    assert "MASTER_PORT" not in runs[1].stderr, runs[1].output


def test_nodes_with_different_manifests_are_refused_naming_the_parts_that_differ(tray_env, tmp_path):
    """Node 1 runs a copy of the manifest with another description and a kernel source one comment longer: the root
    said only that the two digests differ; it now names the parts (each node's parts by digest in its join)."""
    import shutil
    body = """
    with tray.init() as rank:
        rank.barrier()
    """
    other = tmp_path / "other"
    shutil.copytree(MANIFESTS, other)
    doc = json.loads((other / "peer_fill.json").read_text())
    doc["description"] += " (edited)"
    (other / "peer_fill.json").write_text(json.dumps(doc))
    with open(other / "kernels" / "peer_fill.cu", "a") as f:
        f.write("// edited\n")
    runs = finish(start_job(tray_env, body, "--manifest", FILL,
                            node_args={1: ("--manifest", str(other / "peer_fill.json"))}), timeout_s=40)
    assert all(run.returncode == 3 for run in runs), [r.output for r in runs]
    assert "(they differ in description, the source of kernel 'peer_fill'); run every node with the same manifest" \
        in _root_cause(runs[1]), runs[1].output


def test_the_node_of_a_leader_another_node_gave_up_on_tells_of_the_ranks_it_leads(tray_env):
    """As above, the ranks not catching it: node 0's failure names rank 2 (node 1's leader, waiting for rank 3), and
    node 1's head tells of rank 3 as well as rank 2 (it told of rank 2 alone, which was where the others wait)."""
    body = """
    with tray.init() as rank:
        rank.barrier()
        if rank.rank != 3:
            rank.barrier(timeout_s=0.5 if rank.rank < 2 else 3.0)
        else:
            time.sleep(4.5)
    """
    runs = finish(start_job(tray_env, body))
    assert all(run.returncode == 1 for run in runs), [r.output for r in runs]
    assert "rank 2 leads ranks 2,3 on its node" in _root_cause(runs[1]), runs[1].output
    assert re.search(r"node 1: rank 3 is alive, .*running but not where the others wait for it", runs[1].stderr), \
        runs[1].output
