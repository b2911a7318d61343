"""The root's CURVE endpoint during the join: connections that fail the handshake are counted and
logged, never a reason to stop the job; a join that times out says how many failed and from where; a head
with another token stops dialling at its first failed handshake."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import time
from typing import Any

import pytest
import zmq

from tray.handshake import jobwire
from tray.launch.curve import job_keys, make_client
from tray.launch.job import JobSpec
from tray.launch.node import NodeLink
from tray.launch.root import TOKEN_FAILURES, Root
from tray.launch.spec import EXIT_HANDSHAKE

TOKEN = "f00dfeedf00dfeedf00dfeedf00dfeed"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until_stopped(root: Root, within_s: float = 10.0) -> None:
    """Poll the root's sockets and tick it, as node 0's head does, until it stops the job (or `within_s` passes)."""
    poller = zmq.Poller()
    for s in root.sockets():
        poller.register(s, zmq.POLLIN)
    deadline = time.monotonic() + within_s
    while root.stop is None and time.monotonic() < deadline:
        for s, _ in poller.poll(20):
            root.on_readable(s)
        root.tick()


def _stranger(ctx: zmq.Context, port: int, *, knows_root_key: bool) -> zmq.Socket:
    """A CURVE client without the job's token: a head of another job (both keys wrong) or, knowing the
    root's public key, one that ZAP refuses (the only kind whose address libzmq reports)."""
    keys = job_keys("another-token-another-token-0000")
    sock = make_client(ctx, keys)
    if knows_root_key:
        sock.setsockopt(zmq.CURVE_SERVERKEY, job_keys(TOKEN).server_public)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(b"let me in")
    return sock


@pytest.mark.parametrize(("knows_root_key", "where"), [
    ((True,), "from 127.0.0.1"),
    ((False,), "from addresses libzmq does not report"),
    ((False, True), "from 127.0.0.1 and addresses libzmq does not report"),
])
def test_strangers_during_the_join_are_ignored_then_counted_in_the_timeout(capsys, knows_root_key, where):
    port = _free_port()
    job = JobSpec(nnodes=2, node_rank=0, root_host="127.0.0.1", root_port=port, rdzv_id="test", token=TOKEN,
                  source="cli")
    ctx = zmq.Context()
    root = Root(ctx, job, local_world_size=1, manifest="m" * 64, backend="host", groups={}, join_timeout_s=1.0)
    strangers = [_stranger(ctx, port, knows_root_key=k) for k in knows_root_key]
    poller = zmq.Poller()
    for s in root.sockets():
        poller.register(s, zmq.POLLIN)
    failures_before_timeout = 0
    deadline = time.monotonic() + 10.0
    try:
        while root.stop is None and time.monotonic() < deadline:
            for s, _ in poller.poll(20):
                root.on_readable(s)
            if time.monotonic() - root.t_start < root.join_timeout_s:
                failures_before_timeout = root.handshake_failures
            root.tick()
    finally:
        for s in strangers:
            s.close()
        root.close()
        ctx.term()
    # every stranger failed before the deadline, and none of it stopped the job
    assert failures_before_timeout >= len(strangers) and (root.auth_failures > 0) == any(knows_root_key)
    assert root.stop is not None and root.stop.exit_code == EXIT_HANDSHAKE
    summary = root.stop.summary
    assert summary.startswith(f"node(s) 0,1 did not join the root at 127.0.0.1:{port} within 1 s (--timeout-s; "
                              "raise it if nodes start later than that); "
                              f"{root.handshake_failures} connection"), summary
    assert summary.endswith(f" failed the CURVE handshake {where}: a head started with another TRAY_JOB_TOKEN? "
                            "(every node needs the same one)"), summary
    logged = [line for line in capsys.readouterr().err.splitlines() if "failed the CURVE handshake" in line]
    # rate-limited: the first at once, the rest (if any) as the root closes
    assert 1 <= len(logged) <= 2 and all(line.startswith("tray: root: ignored: ") for line in logged), logged


def test_a_join_timeout_without_failed_handshakes_keeps_its_hint():
    port = _free_port()
    job = JobSpec(nnodes=2, node_rank=0, root_host="127.0.0.1", root_port=port, rdzv_id="test", token=TOKEN,
                  source="cli")
    ctx = zmq.Context()
    root = Root(ctx, job, local_world_size=1, manifest="m" * 64, backend="host", groups={}, join_timeout_s=0.0)
    try:
        time.sleep(0.01)
        root.tick()
    finally:
        root.close()
        ctx.term()
    assert root.stop is not None
    assert "within 0 s (--timeout-s; raise it if nodes start later than that); not started, or ended before it " \
        "joined (its head killed or interrupted as it started: its output says), a wrong root address " \
        "(from --rdzv-endpoint or --master-addr), or a firewall" in root.stop.summary
    assert "CURVE" not in root.stop.summary


def test_a_head_with_another_token_stops_dialling_after_a_few_failed_handshakes():
    port = _free_port()
    job = JobSpec(nnodes=2, node_rank=0, root_host="127.0.0.1", root_port=port, rdzv_id="test", token=TOKEN,
                  source="cli")
    other = JobSpec(nnodes=2, node_rank=1, root_host="127.0.0.1", root_port=port, rdzv_id="test",
                    token="another-token-another-token-0000", source="cli")
    join = jobwire.NodeJoin(token=other.token, node_rank=1, nnodes=2, local_world_size=1, rdzv_id="test",
                            hostname="h", pid=1, manifest="m" * 64, backend="host")
    ctx = zmq.Context()
    root = Root(ctx, job, local_world_size=1, manifest="m" * 64, backend="host", groups={}, join_timeout_s=30.0)
    link = NodeLink(ctx, other, join, connect_timeout_s=30.0)
    poller = zmq.Poller()
    for s in (*root.sockets(), link.monitor):
        poller.register(s, zmq.POLLIN)
    # NOTE: the link redials every 100 ms (RECONNECT_IVL); 1 s after its refusal a head that kept
    # dialling would have failed ~10 more handshakes at the root
    refused_at = None
    deadline = time.monotonic() + 10.0
    try:
        while time.monotonic() < deadline and (refused_at is None or time.monotonic() - refused_at < 1.0):
            for s, _ in poller.poll(20):
                if s is link.monitor:
                    link.on_monitor()
                else:
                    root.on_readable(s)
            root.tick()
            if link.refused and refused_at is None:
                refused_at = time.monotonic()
                assert link.closed
                poller.unregister(link.monitor)  # closed with the link
    finally:
        link.close()
        root.close()
        ctx.term()
    assert refused_at is not None, "the link never saw its handshake fail"
    assert "refused this node's CURVE handshake: TRAY_JOB_TOKEN differs" in (link.tick() or "")
    assert TOKEN_FAILURES <= root.handshake_failures <= TOKEN_FAILURES + 1, root.handshake_failures


def test_a_root_that_closes_during_the_handshake_is_not_taken_for_another_token():
    """A peer that accepts the connection and closes it unanswered (a root exiting as this head dials) fails one
    handshake, as a root with another token fails every one: one is no refusal; the link dials on."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    job = JobSpec(nnodes=2, node_rank=1, root_host="127.0.0.1", root_port=port, rdzv_id="test", token=TOKEN,
                  source="cli")
    join = jobwire.NodeJoin(token=TOKEN, node_rank=1, nnodes=2, local_world_size=1, rdzv_id="test",
                            hostname="h", pid=1, manifest="m" * 64, backend="host")
    ctx = zmq.Context()
    link = NodeLink(ctx, job, join, connect_timeout_s=30.0)
    try:
        conn, _ = listener.accept()
        conn.close()
        listener.close()  # the root is gone: later dials are refused by the kernel, with no handshake
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if link.monitor.poll(20):
                link.on_monitor()
        assert link._closed_handshakes == 1
        assert not link.refused and not link.closed
        assert link.tick() is None  # still within its --timeout-s
    finally:
        link.close()
        ctx.term()


def test_a_root_host_that_does_not_resolve_is_said_while_waiting_and_in_the_failure(monkeypatch):
    """ZeroMQ resolves the root's host name as it dials and says nothing when that fails: node 1 waited out
    --timeout-s in silence and then named every cause but that one, where node 0 said at once that the name did not
    resolve. A name that resolves later (a Kubernetes service's record) is still dialled."""
    from tray.launch import node as node_mod

    said: list[str] = []
    answers = [socket.gaierror(-2, "Name or service not known")]

    def getaddrinfo(host, port, *args, **kwargs):
        if answers:
            raise answers[0]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    monkeypatch.setattr(node_mod.socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(node_mod, "say", said.append)
    monkeypatch.setattr(node_mod, "RESOLVE_EVERY_S", 0.02)
    job = JobSpec(nnodes=2, node_rank=1, root_host="node0.invalid", root_port=_free_port(), rdzv_id="test",
                  token=TOKEN, source="cli")
    join = jobwire.NodeJoin(token=TOKEN, node_rank=1, nnodes=2, local_world_size=1, rdzv_id="test",
                            hostname="h", pid=1, manifest="m" * 64, backend="host")
    ctx = zmq.Context()
    link = NodeLink(ctx, job, join, connect_timeout_s=30.0)
    try:
        deadline = time.monotonic() + 5.0
        while not link.unresolved and time.monotonic() < deadline:
            time.sleep(0.01)
        link.t_start -= 11  # 11 s into the wait: said once
        link._last_wait_said -= 11
        assert link.tick() is None
        assert said == [f"node 1: no answer yet from the root (node 0 at node0.invalid:{job.root_port}) (11 s; its "
                        "host 'node0.invalid' (from --rdzv-endpoint or --master-addr) does not resolve ([Errno -2] "
                        "Name or service not known)); gives up after --timeout-s 30 s"], said
        link.t_start -= 20
        reason = link.tick() or ""
        assert reason.startswith("could not reach the root (node 0 at node0.invalid:") and reason.endswith(
            "within 30 s (--timeout-s): its host 'node0.invalid' (from --rdzv-endpoint or --master-addr) does not "
            "resolve ([Errno -2] Name or service not known); give a name or address every node can resolve (or wait "
            "longer for its record: --timeout-s)"), reason
        answers.clear()  # the record comes
        deadline = time.monotonic() + 5.0
        while link.unresolved and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.unresolved == ""
        assert "could not reach the root" in (link.tick() or "") and "resolve" not in (link.tick() or "")
    finally:
        link.close()
        ctx.term()


def test_a_connection_that_never_finishes_the_handshake_is_dropped_and_descriptors_are_raised(monkeypatch):
    """Anyone who reaches the root's port may open connections and say nothing: each held a descriptor of node 0's
    head for ZeroMQ's default 30 s, and 1100 of them under `ulimit -n 1024` kept the real node out and broke the
    head's teardown. Now such a connection is dropped after 5 s, and the root's soft descriptor limit is its hard
    one."""
    import resource

    from tray.launch import root as root_mod

    monkeypatch.setattr(root_mod, "_HANDSHAKE_MS", 300)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, hard, 512)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    port = _free_port()
    job = JobSpec(nnodes=2, node_rank=0, root_host="127.0.0.1", root_port=port, rdzv_id="test", token=TOKEN,
                  source="cli")
    ctx = zmq.Context()
    try:
        root = Root(ctx, job, local_world_size=1, manifest="m" * 64, backend="host", groups={}, join_timeout_s=30.0)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
        idle = socket.create_connection(("127.0.0.1", port), timeout=5.0)
        poller = zmq.Poller()
        for s in root.sockets():
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + 5.0
        closed = False
        idle.settimeout(0.02)
        while not closed and time.monotonic() < deadline:
            for s, _ in poller.poll(20):
                root.on_readable(s)
            try:
                data = idle.recv(4096)   # the root's greeting, then nothing; b"" once it dropped us
                closed = data == b""
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
        idle.close()
        root.close()
        assert closed, "the root kept a connection that never finished its handshake"
    finally:
        ctx.term()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_one_connection_closed_during_its_handshake_is_not_blamed_on_the_token():
    """A head killed while it dialled fails one handshake at the root; a head with another token fails one every
    0.1 s. At the join's deadline one failure is said as either, not as a token that differs."""
    port = _free_port()
    job = JobSpec(nnodes=2, node_rank=0, root_host="127.0.0.1", root_port=port, rdzv_id="test", token=TOKEN,
                  source="cli")
    ctx = zmq.Context()
    root = Root(ctx, job, local_world_size=1, manifest="m" * 64, backend="host", groups={}, join_timeout_s=1.0)
    try:
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(b"\xff" + bytes(8) + b"\x7f")  # a ZMTP greeting begun, then the peer is gone
        _until_stopped(root)
    finally:
        root.close()
        ctx.term()
    assert root.stop is not None and root.handshake_failures == 1, (root.handshake_failures, root.stop)
    assert root.stop.summary.endswith("1 connection failed the CURVE handshake from addresses libzmq does not "
                                      "report: a head that stopped while connecting, or one started with another "
                                      "TRAY_JOB_TOKEN"), root.stop.summary


@pytest.mark.parametrize(("node_rank", "pause_s", "silent_s", "says"), [
    (1, 0.02, 2.0, "lost the root (node 0 at 127.0.0.1:"),   # the root went quiet while this head ran
    (1, 1.3, 2.0, "this head did not run for 1.3 s"),       # a pause shorter than the timeout ended the silence
    (0, 1.3, 2.0, "this head did not run for 1.3 s"),       # node 0: its own root, in this process, went quiet
    (0, 0.02, 2.0, "this head did not run for most of 2.0 s"),
    (1, 0.02, 1.0, None),                                    # within the timeout: nothing to say
])
def test_a_silence_a_pause_of_this_head_made_is_said_as_its_own(node_rank, pause_s, silent_s, says):
    """The link's verdict on a silence past --node-heartbeat-timeout-s (1.5 s here): a pause of this head (SIGSTOP)
    a little shorter than the timeout, ending a silence past it, is this head's own doing, and so is any silence of
    node 0's own root; otherwise the root is lost."""
    job = JobSpec(nnodes=2, node_rank=node_rank, root_host="127.0.0.1", root_port=_free_port(), rdzv_id="test",
                  token=TOKEN, source="cli", node_heartbeat_timeout_s=1.5)
    join = jobwire.NodeJoin(token=TOKEN, node_rank=node_rank, nnodes=2, local_world_size=1, rdzv_id="test",
                            hostname="h", pid=1, manifest="m" * 64, backend="host")
    ctx = zmq.Context()
    link = NodeLink(ctx, job, join, connect_timeout_s=30.0)
    try:
        link.last_heard = time.monotonic() - silent_s
        link._last_tick = time.clock_gettime(time.CLOCK_BOOTTIME) - pause_s
        said = link.tick()
    finally:
        link.close()
        ctx.term()
    if says is None:
        assert said is None
    else:
        assert said is not None and says in said, said


def test_the_roots_host_is_asked_for_again_until_it_resolves(monkeypatch):
    """A PyTorchJob's root names its own service (PET_MASTER_ADDR), whose DNS record may come after the pod starts:
    the name is asked for again within the wait, and a name that never resolves is named with its source."""
    import socket

    from tray.errors import UsageError
    from tray.launch import root

    answers = [OSError("no name yet"), OSError("no name yet"), "10.0.0.7"]

    def resolve(host: str) -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(socket, "gethostbyname", resolve)
    monkeypatch.setattr(root, "_RESOLVE_EVERY_S", 0.01)
    assert root.bind_address("tray-job-master-0", 23456, "pytorchjob", wait_s=5.0) == "tcp://10.0.0.7:23456"
    answers[:] = [OSError("no name")] * 1000
    with pytest.raises(UsageError, match=r"'tray-job-master-0' \(from PET_MASTER_ADDR\) did not resolve within 0.1 s"):
        root.bind_address("tray-job-master-0", 23456, "pytorchjob", wait_s=0.1)
    with pytest.raises(UsageError, match=r"\(from --rdzv-endpoint or --master-addr or LWS_LEADER_ADDRESS\)"):
        root.bind_address("x", 1, "cli+lws")


def test_a_node_speaks_only_for_its_own_ranks():
    """Node 1 (ranks 2, 3) that votes as rank 0, or reports rank 0 failed or gone: refused, logged, and never counted
    as rank 0's; its own ranks' vote is taken. A message naming another node is refused as before."""
    port = _free_port()
    job = JobSpec(nnodes=2, node_rank=0, root_host="127.0.0.1", root_port=port, rdzv_id="test", token=TOKEN,
                  source="cli")
    ctx = zmq.Context()
    root = Root(ctx, job, local_world_size=2, manifest="m" * 64, backend="host", groups={}, join_timeout_s=30.0)
    try:
        for n in range(2):
            join = jobwire.NodeJoin(token=TOKEN, node_rank=n, nnodes=2, local_world_size=2, rdzv_id="test",
                                    hostname="h", pid=100 + n, manifest="m" * 64, backend="host")
            root._on_message(f"node-{n}".encode(), join.to_msgpack())
        assert sorted(root.nodes) == [0, 1] and root.stop is None

        def vote(node_rank: int, ranks: tuple[int, ...]) -> bytes:
            return jobwire.NodeVote(token=TOKEN, node_rank=node_rank, topic="x/world", round=1, ranks=ranks,
                                    values=tuple(7 for _ in ranks), waits=tuple(10.0 for _ in ranks)).to_msgpack()

        root._on_message(b"node-1", vote(1, (0,)))
        root._on_message(b"node-1", vote(1, (2, 1)))
        root._on_message(b"node-1", jobwire.NodeLeft(token=TOKEN, node_rank=1, rank=0, how="exited 0").to_msgpack())
        root._on_message(b"node-1", jobwire.NodeFailure.bounded(token=TOKEN, node_rank=1, rank=0, summary="forged",
                                                                report="", tail=(), exit_code=1).to_msgpack())
        root._on_message(b"node-1", vote(0, (0,)))
        assert root.stop is None and not root.left
        assert all(0 not in s.values and 1 not in s.values for s in root.steps.values())
        assert len(root.rejected) == 5, root.rejected
        assert "node_vote from node 1 names rank(s) 0, not of that node (its ranks are 2..3)" in root.rejected[0]
        assert "names rank(s) 1, not of that node" in root.rejected[1]
        assert "has not joined as that node" in root.rejected[4]
        root._on_message(b"node-1", vote(1, (2, 3)))
        assert [dict(s.values) for s in root.steps.values()] == [{2: 7, 3: 7}]
    finally:
        root.close()
        ctx.term()


def test_a_vote_whose_topic_carries_a_number_of_thousands_of_digits_stops_the_job_naming_it():
    """A group step's topic carries rank numbers; one of 5000 digits (int() refuses it) names no instance of the
    manifest: the root stops the job for that vote, as for any unknown instance, instead of raising."""
    from tray.handshake.steps import step_voters

    groups = {"world": ((0, 1, 2, 3),)}
    huge = "1" * 5000
    assert step_voters(f"tray:group:world@{huge}:barrier", 4, groups) is None
    assert step_voters(f"tray:group:world@0:pair-{huge}-2", 4, groups) is None
    assert step_voters("tray:group:world@0:pair-1-2", 4, groups) == (1, 2)
    port = _free_port()
    job = JobSpec(nnodes=2, node_rank=0, root_host="127.0.0.1", root_port=port, rdzv_id="test", token=TOKEN,
                  source="cli")
    ctx = zmq.Context()
    root = Root(ctx, job, local_world_size=2, manifest="m" * 64, backend="host", groups=groups, join_timeout_s=30.0)
    try:
        for n in range(2):
            join = jobwire.NodeJoin(token=TOKEN, node_rank=n, nnodes=2, local_world_size=2, rdzv_id="test",
                                    hostname="h", pid=100 + n, manifest="m" * 64, backend="host")
            root._on_message(f"node-{n}".encode(), join.to_msgpack())
        vote = jobwire.NodeVote(token=TOKEN, node_rank=1, topic=f"tray:group:world@{huge}:barrier", round=0,
                                ranks=(2,), values=(None,), waits=(10.0,))
        root._on_message(b"node-1", vote.to_msgpack())
        assert root.stop is not None and root.stop.node_rank == 1 and root.stop.rank == 2
        assert "names no group instance of the manifest" in root.stop.summary
    finally:
        root.close()
        ctx.term()


def test_a_nodes_steps_out_of_order_are_refused_and_a_vote_without_a_finite_timeout_is_not_timed():
    """A node's ready before the job's table, its ready or offers twice: each refused and logged (two readies before
    any table made the root send go with no table); a group step whose vote carries a NaN timeout is not timed (NaN
    never compares greater: it stood as a deadline that never came), its heads' own deadlines stand."""
    port = _free_port()
    job = JobSpec(nnodes=2, node_rank=0, root_host="127.0.0.1", root_port=port, rdzv_id="test", token=TOKEN,
                  source="cli")
    ctx = zmq.Context()
    root = Root(ctx, job, local_world_size=2, manifest="m" * 64, backend="host",
                groups={"world": ((0, 1, 2, 3),)}, join_timeout_s=30.0)
    try:
        for n in range(2):
            join = jobwire.NodeJoin(token=TOKEN, node_rank=n, nnodes=2, local_world_size=2, rdzv_id="test",
                                    hostname="h", pid=100 + n, manifest="m" * 64, backend="host")
            root._on_message(f"node-{n}".encode(), join.to_msgpack())
        for n in range(2):
            root._on_message(f"node-{n}".encode(), jobwire.NodeReady(token=TOKEN, node_rank=n, timings={}).to_msgpack())
        assert root.t_go is None and len(root.rejected) == 2
        assert "node 1 said ready before the job's table was sent" in root.rejected[1]
        for n in (0, 0, 1):
            offers = jobwire.NodeOffers(token=TOKEN, node_rank=n, joins={})
            root._on_message(f"node-{n}".encode(), offers.to_msgpack())
        assert root.t_table is not None and "node 0 sent its offers again" in root.rejected[2]
        for n in (0, 0):
            root._on_message(f"node-{n}".encode(), jobwire.NodeReady(token=TOKEN, node_rank=n, timings={}).to_msgpack())
        assert root.t_go is None and "node 0 said ready again" in root.rejected[3]
        root._on_message(b"node-1", jobwire.NodeReady(token=TOKEN, node_rank=1, timings={}).to_msgpack())
        assert root.t_go is not None and len(root.rejected) == 4
        topic = "tray:group:world@0:barrier"
        for t in (float("nan"), 0.05):
            vote = jobwire.NodeVote(token=TOKEN, node_rank=1, topic=topic, round=int(t == t), ranks=(2,),
                                    values=({"timeout_s": t},), waits=(10.0,))
            root._on_message(b"node-1", vote.to_msgpack())
        assert [s.timeout_s for s in root.steps.values()] == [None, 0.05]
    finally:
        root.close()
        ctx.term()


def _joined_root(ctx: zmq.Context, nnodes: int, local_world_size: int = 1, groups: dict | None = None,
                 **job: object) -> Root:
    """A root of `nnodes` nodes, every one joined (messages handed to it as its socket would)."""
    spec = JobSpec(nnodes=nnodes, node_rank=0, root_host="127.0.0.1", root_port=_free_port(), rdzv_id="test",
                   token=TOKEN, source="cli", **job)
    root = Root(ctx, spec, local_world_size=local_world_size, manifest="m" * 64, backend="host", groups=groups or {},
                join_timeout_s=30.0)
    for n in range(nnodes):
        join = jobwire.NodeJoin(token=TOKEN, node_rank=n, nnodes=nnodes, local_world_size=local_world_size,
                                rdzv_id="test", hostname="h", pid=100 + n, manifest="m" * 64, backend="host")
        root._on_message(f"node-{n}".encode(), join.to_msgpack())
    assert len(root.nodes) == nnodes and root.stop is None
    return root


def test_a_tray_wide_step_costs_the_root_no_pass_over_every_voter_at_each_vote(monkeypatch):
    """A job-wide step is decided when the root has heard every voter: each node's vote is checked against its own
    ranks, not by a pass over the job's W voters (which made one step O(nodes x ranks) at the root)."""
    from tray.launch import root as root_module

    passes = [0]

    class Voters(tuple):  # counts the passes over the step's voters
        def __iter__(self):  # type: ignore[no-untyped-def]
            passes[0] += 1
            return super().__iter__()

    monkeypatch.setattr(root_module, "step_voters", lambda topic, world, *a: Voters(range(world)))
    ctx = zmq.Context()
    root = _joined_root(ctx, 64)
    sent: list[bytes] = []
    monkeypatch.setattr(root, "_send_frames", lambda ident, frames: sent.append(ident))
    try:
        for n in range(64):
            vote = jobwire.NodeVote(token=TOKEN, node_rank=n, topic="step", round=1, ranks=(n,), values=(n,),
                                    waits=(10.0,))
            root._on_message(f"node-{n}".encode(), vote.to_msgpack())
            assert bool(root.steps) == (n < 63)
        assert sorted(sent) == sorted(f"node-{n}".encode() for n in range(64))  # one decision per node
        assert passes[0] <= 8, passes[0]
    finally:
        root.close()
        ctx.term()


def test_the_root_looks_for_a_lost_node_when_one_can_be_lost_not_at_every_turn(monkeypatch):
    """The root's tick runs at every turn of node 0's loop (about one per message); its look over every node for one
    silent past the heartbeat timeout is due only when the oldest silence can pass it: the node is still named as
    soon as it does."""
    calls = [0]
    look = Root._check_lost

    def counted(self: Root, now: float) -> None:
        calls[0] += 1
        look(self, now)

    monkeypatch.setattr(Root, "_check_lost", counted)
    ctx = zmq.Context()
    root = _joined_root(ctx, 32, node_heartbeat_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        beat = [jobwire.Beat(token=TOKEN, node_rank=n, seq=1).to_msgpack() for n in range(32)]
        turns = 0
        while root.stop is None and time.monotonic() - t0 < 5.0:
            for n in range(1, 32):  # node 0 falls silent; the others are heard from at every turn
                root._on_message(f"node-{n}".encode(), beat[n])
            root.tick()
            turns += 1
            time.sleep(0.001)
        took = time.monotonic() - root.nodes[0].last_seen  # its silence when named
    finally:
        root.close()
        ctx.term()
    assert root.stop is not None and root.stop.summary.startswith("node 0 (h, head pid 100) lost: no heartbeat for ")
    assert 0.5 < took < 0.5 + 0.2, took  # named as soon as its silence passed the timeout
    assert turns > 50 and calls[0] <= 3, (turns, calls[0])


def test_a_head_encodes_the_jobs_decision_and_table_once_for_all_its_ranks(monkeypatch):
    """The job's table and each decision hold an entry per rank of the job: a head encodes each once and sends those
    bytes to each of its ranks (it encoded them once per rank: O(ranks of the job x ranks of the node) per step)."""
    from types import SimpleNamespace

    from tray.handshake import wire
    from tray.launch.node import NodeHead

    encoded: list[str] = []
    for cls in (wire.Decision, wire.Table):
        monkeypatch.setattr(cls, "to_msgpack", lambda self, limit=wire.MAX_MESSAGE_NBYTES, _f=cls.to_msgpack:
                            encoded.append(self.KIND) or _f(self, limit))
    sent: list[tuple[str, bytes]] = []
    procs = [SimpleNamespace(rank=r) for r in (4, 5, 6, 7)]
    offers = {r: wire.Offer(token=TOKEN, rank=r, world_size=16, host="boot", pid=100 + r, uid=0,
                            device=wire.DeviceIdentity(ordinal=r % 4, uuid=f"host-{r % 4}", pci_bus="", numa_node=-1),
                            backend="host", manifest="a" * 64, fd_socket=f"/j/rank-{r}.fds", buffers=(), groups={},
                            timings={}) for r in (4, 5, 6, 7)}
    head = SimpleNamespace(
        _rank_sock=object(), votes={("x", 1): {r: r for r in (4, 5, 6, 7)}}, _forget_waits=lambda key: None,
        _expired=set(), _forwarded={("x", 1)}, token=TOKEN, procs=procs, _t_offered=None, t_table=None, world_size=16,
        offers=offers, rank_base=4, spec=SimpleNamespace(nprocs=4),
        _send_bytes=lambda sock, ident, data, kind: sent.append((ident, data)),
        _send=lambda sock, ident, msg: sent.append((ident, wire.encode(msg))))
    decision = jobwire.JobDecision(token=TOKEN, topic="x", round=1, ranks=tuple(range(16)), values=tuple(range(16)),
                                   missing=(), waited_s=0.0)
    NodeHead._on_job_message(head, decision)  # type: ignore[arg-type]
    job_joins = {0: {"tray:leaders:world": b"\x01" * 128}, 4: {"tray:leaders:ep": b"\x02" * 128}}  # 4 is its own
    NodeHead._on_job_message(head, jobwire.JobTable(token=TOKEN, joins=job_joins))  # type: ignore[arg-type]
    assert encoded == ["decision", "table"], encoded
    assert [ident for ident, _ in sent] == [f"rank-{r}" for r in (4, 5, 6, 7)] * 2
    assert wire.decode(sent[0][1], token=TOKEN).values == tuple(range(16))
    table = wire.decode(sent[-1][1], token=TOKEN)
    assert table.offers == tuple(offers.values()) and table.joins == {0: {"tray:leaders:world": b"\x01" * 128}}


def test_a_heads_vote_in_a_tray_wide_step_takes_no_pass_over_the_jobs_ranks(monkeypatch):
    """Every rank of the job votes in a tray-wide step: a head forwards its node's votes once all its own ranks voted,
    and judges its steps (crossed, abandoned by a rank that left) over its own ranks, knowing them from its node rank:
    no list of the job's W voters is built and searched at each vote."""
    from types import SimpleNamespace

    from tray.handshake import wire
    from tray.launch import head as head_module
    from tray.launch import node

    built = [0]
    for module in (head_module, node):
        monkeypatch.setattr(module, "step_voters", lambda *a, _f=module.step_voters: built.__setitem__(
            0, built[0] + 1) or _f(*a))
    sent: list[jobwire.NodeVote] = []
    failed: list[object] = []
    head = SimpleNamespace(
        world_size=4096, rank_base=12, spec=SimpleNamespace(nprocs=4), resolved=SimpleNamespace(groups={}), votes={},
        _expired=set(), _waits_until={}, _last_vote={}, _forwarded=set(), _held_said=frozenset(), token=TOKEN,
        failure=None,
        procs=[SimpleNamespace(rank=r, returncode=None, phase="running") for r in range(12, 16)],
        job=SimpleNamespace(token=TOKEN, node_rank=3), link=SimpleNamespace(send=sent.append),
        _note_wait=lambda key, vote: (
            head._waits_until.setdefault(key, {}).__setitem__(vote.rank, time.monotonic() + 9),
            head._last_vote.__setitem__(vote.rank, key)),
        _tell_left=lambda: None, _fail=failed.append)
    for name in ("_voters_here", "_not_voted", "_waits", "_check_crossed_steps", "_check_abandoned_steps"):
        setattr(head, name, getattr(head_module.Head, name).__get__(head))
    for r in (13, 12, 15, 14):
        vote = wire.Vote(token=TOKEN, rank=r, topic="step", round=1, value=r, wait_s=10.0)
        node.NodeHead._on_vote(head, object(), vote)  # type: ignore[arg-type]
    assert [(m.ranks, m.values) for m in sent] == [((12, 13, 14, 15), (12, 13, 14, 15))] and not failed
    assert built[0] == 0


def test_a_job_larger_than_node_0s_open_file_limit_is_refused_naming_it_and_a_large_one_gets_its_listen_queue(
        monkeypatch):
    """Node 0's head holds a TCP connection per node: past its open-file limit libzmq leaves connections unaccepted,
    and the join timed out naming those nodes as not started. A job that cannot fit is refused at once, naming the
    limit and how to raise it; one that fits gets a listen queue for every node dialling at once."""
    from tray.errors import UsageError
    from tray.launch import root as root_module

    ctx = zmq.Context()
    try:
        job = JobSpec(nnodes=1000, node_rank=0, root_host="127.0.0.1", root_port=_free_port(), rdzv_id="test",
                      token=TOKEN, source="cli")
        monkeypatch.setattr(root_module, "raise_fd_soft_limit", lambda: (1024, 1024))
        with pytest.raises(UsageError, match=r"a job of 1000 nodes needs about 1096 open files there, and this "
                                             r"process may open 1024 \(ulimit -n; hard limit 1024\); raise the limit "
                                             r"where node 0's head starts \(ulimit -n 1096"):
            Root(ctx, job, local_world_size=4, manifest="m" * 64, backend="host", groups={}, join_timeout_s=1.0)
        monkeypatch.setattr(root_module, "raise_fd_soft_limit", lambda: (4096, 4096))
        root = Root(ctx, job, local_world_size=4, manifest="m" * 64, backend="host", groups={}, join_timeout_s=1.0)
        try:
            assert root.sock.getsockopt(zmq.BACKLOG) == 1000
        finally:
            root.close()
    finally:
        ctx.term()


def _wide_offer(rank: int, world: int, nbuffers: int) -> Any:
    """A rank's offer exporting `nbuffers` fabric-shared buffers: ~100 B each on the wire."""
    from tray.handshake import wire

    return wire.Offer(token=TOKEN, rank=rank, world_size=world, host="boot", pid=100 + rank, uid=0,
                      device=wire.DeviceIdentity(ordinal=0, uuid=f"GPU-{rank}", pci_bus="", numa_node=-1),
                      backend="host", manifest="a" * 64, fd_socket=f"/j/rank-{rank}.fds",
                      buffers=tuple(wire.BufferOffer(name=f"b{i}", nbytes=4096, handle="fabric", fabric=bytes(64))
                                    for i in range(nbuffers)),
                      groups={}, timings={})


def _run_root(root: Root, links: list, until, within_s: float = 20.0) -> list:
    """Poll the root and the links' sockets as heads do until `until(received)` holds (received: every message the
    links got, decoded as a head decodes it); returns what they got."""
    poller = zmq.Poller()
    for s in (*root.sockets(), *(link.sock for link in links)):
        poller.register(s, zmq.POLLIN)
    got: list = []
    deadline = time.monotonic() + within_s
    while not until(got):
        assert time.monotonic() < deadline, f"nothing more within {within_s} s; got {[m.KIND for m in got]}"
        for s, _ in poller.poll(20):
            if s in root.sockets():
                root.on_readable(s)
        for link in links:
            got.extend(link.receive())
            assert link.tick() is None
        root.tick()
    return got


def _job_of(nnodes: int, local: int, port: int) -> tuple[JobSpec, list[JobSpec], list]:
    job = JobSpec(nnodes=nnodes, node_rank=0, root_host="127.0.0.1", root_port=port, rdzv_id="test", token=TOKEN,
                  source="cli")
    specs = [JobSpec(nnodes=nnodes, node_rank=n, root_host="127.0.0.1", root_port=port, rdzv_id="test", token=TOKEN,
                     source="cli") for n in range(nnodes)]
    joins = [jobwire.NodeJoin(token=TOKEN, node_rank=n, nnodes=nnodes, local_world_size=local, rdzv_id="test",
                              hostname=f"h{n}", pid=10 + n, manifest="m" * 64, backend="host") for n in range(nnodes)]
    return job, specs, joins


def _root_and_links(nnodes: int, local: int, groups: dict | None = None):
    job, specs, joins = _job_of(nnodes, local, _free_port())
    ctx = zmq.Context()
    root = Root(ctx, job, local_world_size=local, manifest="m" * 64, backend="host", groups=groups or {},
                join_timeout_s=30.0)
    links = [NodeLink(ctx, specs[n], joins[n], 30.0) for n in range(nnodes)]
    _run_root(root, links, lambda got: sum(m.KIND == "beat" for m in got) >= nnodes)
    return ctx, root, links


def _close(ctx, root, links) -> None:
    for link in links:
        link.close(linger_ms=0)
    root.close()
    ctx.term()


def test_the_root_sends_each_node_the_join_info_of_the_groups_its_ranks_are_in_and_no_offer():
    """Every node got every rank's offer (~0.6 KiB a rank with two exported buffers), so the table grew with the square
    of the job (8,000 ranks: 5.1 MB to each node) though a node's ranks map peers within their node only. A node now
    sends the root the join info its ranks offered (of the groups that span nodes), and the root sends each node that
    of the ranks leading an instance of a group with a member on it: one message for every node alike."""
    from tray.handshake import wire

    nnodes, local, nbuf = 3, 100, 30  # 300 ranks of 30 exported buffers: every offer in every table took 1.2 MB
    world = nnodes * local
    pairs = tuple((r, r + local) for r in range(local))  # pairs across nodes 0 and 1 (node 2 is in none)
    groups = {"world": (tuple(range(world)),), "pairs": pairs, "node": tuple(
        tuple(range(n * local, (n + 1) * local)) for n in range(nnodes))}
    ctx, root, links = _root_and_links(nnodes, local, groups=groups)
    sent = []
    real = root._send_frames
    root._send_frames = lambda ident, frames: sent.append((ident, frames)) or real(ident, frames)
    try:
        offers = [_wide_offer(r, world, nbuf) for r in range(world)]
        ids = {r: bytes([r % 256]) * 128 for r in range(local)}
        offers[0] = dataclasses.replace(offers[0], groups={"tray:leaders:world": b"\x01" * 128, "node": b"",
                                                           "tray:leaders:pairs": ids[0]})
        for r in range(1, local):
            offers[r] = dataclasses.replace(offers[r], groups={"tray:leaders:pairs": ids[r]})
        for n, link in enumerate(links):
            link.send(jobwire.NodeOffers(token=TOKEN, node_rank=n,
                                         joins=wire.joins_of(offers[n * local:(n + 1) * local])))
        got = _run_root(root, links, lambda got: sum(m.KIND == "job_table" for m in got) == nnodes)
        tables = {bytes(i): jobwire.decode(jobwire.message_of(f, root.limit), token=TOKEN, limit=root.limit)
                  for i, f in sent if jobwire.decode(jobwire.message_of(f, root.limit), token=TOKEN,
                                                     limit=root.limit).KIND == "job_table"}
        by_node = {root.by_ident[i]: t.joins for i, t in tables.items()}
        every = wire.joins_of(offers[:local])
        assert by_node[0] == every and by_node[1] == every  # the pairs' leaders: node 0's ranks, for nodes 0 and 1
        assert by_node[2] == {0: every[0]}  # node 2 is in the world group alone
        assert len(tables) == 3 and root.stop is None and len(got) >= 3
        assert max(len(jobwire.JobTable(token=TOKEN, joins=j).to_msgpack()) for j in by_node.values()) < 200 * local
    finally:
        _close(ctx, root, links)


def test_nodes_that_need_the_same_join_info_get_one_message_encoded_once(monkeypatch):
    """A group over the whole job (the common case): every node needs its leader's id alone, and gets the same bytes."""
    from tray.handshake import wire

    nnodes, local = 4, 2
    ctx, root, links = _root_and_links(nnodes, local, groups={"world": (tuple(range(nnodes * local)),)})
    encoded = []
    monkeypatch.setattr(jobwire.JobTable, "to_msgpack", lambda self, limit=wire.MAX_MESSAGE_NBYTES,
                        _f=jobwire.JobTable.to_msgpack: encoded.append(self.joins) or _f(self, limit))
    try:
        for n, link in enumerate(links):
            link.send(jobwire.NodeOffers(token=TOKEN, node_rank=n, joins={0: {"tray:leaders:world": b"\x09" * 128}}
                                         if n == 0 else {}))
        got = _run_root(root, links, lambda got: sum(m.KIND == "job_table" for m in got) == nnodes)
        assert [m.joins for m in got if m.KIND == "job_table"] == [{0: {"tray:leaders:world": b"\x09" * 128}}] * nnodes
        assert encoded == [{0: {"tray:leaders:world": b"\x09" * 128}}]
    finally:
        _close(ctx, root, links)


def test_a_jobs_table_past_one_mib_reaches_every_head_in_a_job_of_many_ranks():
    """A message with an entry per rank may take 4 KiB per rank where that is more than 1 MiB; the heads decode the
    table within that: 400 ranks of 3 KB join info each."""
    from tray.handshake import wire

    nnodes, local = 2, 200
    # every rank leads an instance of "g" with a member on each node: both nodes need every rank's join info
    ctx, root, links = _root_and_links(nnodes, local, groups={"g": tuple(
        (r, (r + local) % (nnodes * local)) for r in range(nnodes * local))})
    try:
        joins = {r: {"g": bytes([r % 256]) * 3000} for r in range(nnodes * local)}
        for n, link in enumerate(links):
            link.send(jobwire.NodeOffers(token=TOKEN, node_rank=n,
                                         joins={r: joins[r] for r in range(n * local, (n + 1) * local)}))
        got = _run_root(root, links, lambda got: sum(m.KIND == "job_table" for m in got) == nnodes)
        table = next(m for m in got if m.KIND == "job_table")
        nbytes = len(table.to_msgpack(wire.job_message_limit(nnodes * local)))
        assert wire.MAX_MESSAGE_NBYTES < nbytes <= wire.job_message_limit(nnodes * local), nbytes
        assert table.joins == joins and root.stop is None
    finally:
        _close(ctx, root, links)


def test_join_info_that_passes_the_tables_limit_is_refused_before_every_node_offered():
    """A job whose join info cannot fit one table was refused only once every node had offered (at 1,000 nodes, after
    every head had started its ranks and they had allocated). The root stops the job at the message that passes the
    limit, naming the sizes and what to change."""
    nnodes, local = 3, 2  # ~0.6 MB of join info per node; a table of 6 ranks may take 1 MiB
    ctx, root, links = _root_and_links(nnodes, local)
    try:
        for n in (0, 1):  # node 2 never offers: the job is refused without it
            links[n].send(jobwire.NodeOffers(token=TOKEN, node_rank=n, joins={
                r: {f"g{i}": bytes(4000) for i in range(75)} for r in range(n * local, (n + 1) * local)}))
        got = _run_root(root, links, lambda got: sum(m.KIND == "job_stop" for m in got) == nnodes)
    finally:
        _close(ctx, root, links)
    stop = next(m for m in got if m.KIND == "job_stop")
    assert stop.exit_code == EXIT_HANDSHAKE and "job_table" not in [m.KIND for m in got]
    assert re.fullmatch(r"the job's table cannot hold every rank's join info: that of 2 of 3 nodes takes \d+ B, and a "
                        r"table of 6 ranks may take 1048576 B \(1 MiB, or 4096 B per rank in a job of more than 256 "
                        r"ranks\); span fewer groups across nodes \(the manifest's groups\), or run fewer ranks per "
                        r"job", stop.summary), stop.summary


def test_a_node_that_forwards_another_nodes_join_info_stops_the_job():
    """A node speaks for its own ranks: join info of another node's rank in its offers stops the job, naming it."""
    ctx, root, links = _root_and_links(2, 2)
    try:
        links[1].send(jobwire.NodeOffers(token=TOKEN, node_rank=1, joins={0: {"g": b"x"}}))
        got = _run_root(root, links, lambda got: sum(m.KIND == "job_stop" for m in got) == 2)
    finally:
        _close(ctx, root, links)
    stop = next(m for m in got if m.KIND == "job_stop")
    assert stop.exit_code == EXIT_HANDSHAKE
    assert "node 1 forwarded the join info of ranks [0], not its own (ranks 2..3)" in stop.summary, stop.summary


def test_a_head_hands_its_ranks_a_table_and_a_decision_past_one_mib_in_a_job_of_many_ranks():
    """A head re-encodes the root's table and decisions for its ranks: within the job's limit, not 1 MiB."""
    from types import SimpleNamespace

    from tray.handshake import wire
    from tray.launch.node import NodeHead

    world = 400
    sent: list[bytes] = []
    head = SimpleNamespace(
        _rank_sock=object(), votes={("x", 1): {0: None}}, _forget_waits=lambda key: None, _expired=set(),
        _forwarded=set(), token=TOKEN, procs=[SimpleNamespace(rank=0)], _t_offered=None, t_table=None,
        world_size=world, offers={0: _wide_offer(0, world, 30)}, rank_base=0, spec=SimpleNamespace(nprocs=1),
        _send_bytes=lambda sock, ident, data, kind: sent.append(data))
    big = "v" * 3000  # 400 x 3 KB: a decision of 1.2 MB
    NodeHead._on_job_message(head, jobwire.JobDecision(  # type: ignore[arg-type]
        token=TOKEN, topic="x", round=1, ranks=tuple(range(world)), values=(big,) * world, missing=(), waited_s=0.0))
    NodeHead._on_job_message(head, jobwire.JobTable(  # type: ignore[arg-type]
        token=TOKEN, joins={r: {"g": b"j" * 3000} for r in range(1, world)}))  # another 1.2 MB
    assert len(sent) == 2 and all(len(d) > wire.MAX_MESSAGE_NBYTES for d in sent), [len(d) for d in sent]
    limit = wire.job_message_limit(world)
    assert wire.decode(sent[0], token=TOKEN, limit=limit).values == (big,) * world
    table = wire.decode(sent[1], token=TOKEN, limit=limit)
    assert len(table.offers) == 1 and len(table.joins) == world - 1


def test_a_nodes_votes_past_one_mib_reach_the_root_in_a_job_of_many_ranks():
    """Past 256 ranks a rank may vote ~4 KiB: a node of 300 such ranks votes 1.2 MB in one message, which its head could
    not encode and the root would not take (1 MiB each); both now take the job's limit."""
    from tray.handshake import wire

    nnodes, local = 2, 300
    ctx, root, links = _root_and_links(nnodes, local)
    try:
        value = "v" * (wire.vote_limit_nbytes(nnodes * local) - 200)
        for n, link in enumerate(links):
            ranks = tuple(range(n * local, (n + 1) * local))
            vote = jobwire.NodeVote(token=TOKEN, node_rank=n, topic="x", round=1, ranks=ranks, values=(value,) * local,
                                    waits=(30.0,) * local)
            assert len(vote.to_msgpack(link.limit)) > wire.MAX_MESSAGE_NBYTES
            link.send(vote)
        got = _run_root(root, links, lambda got: sum(m.KIND == "job_decision" for m in got) == nnodes)
        assert [m.values == (value,) * nnodes * local for m in got if m.KIND == "job_decision"] == [True] * nnodes
        assert root.stop is None and root.rejects == 0, root.rejected
    finally:
        _close(ctx, root, links)


def test_a_late_voter_of_a_step_that_timed_out_gets_its_decision_past_one_mib():
    """A group step's decision, once timed out, is kept for its late voters: it was kept as a message and encoded again
    for each within 1 MiB, so a decision past that (a job of many ranks) raised in node 0's head as a late vote came.
    It is kept as the bytes its voters got."""
    from tray.handshake.steps import group_topic

    nnodes, local = 2, 150
    members = tuple(range(nnodes * local))
    ctx, root, links = _root_and_links(nnodes, local, groups={"g": (members,)})
    topic = group_topic("g", members, "gather")
    value = {"timeout_s": 0.3, "data": "v" * 3500}  # 299 x 3.5 KB: a decision of 1.05 MB
    late = members[-1]
    try:
        for n, link in enumerate(links):
            ranks = tuple(r for r in range(n * local, (n + 1) * local) if r != late)
            link.send(jobwire.NodeVote(token=TOKEN, node_rank=n, topic=topic, round=1, ranks=ranks,
                                       values=(value,) * len(ranks), waits=(0.3,) * len(ranks)))
        got = _run_root(root, links, lambda got: sum(m.KIND == "job_decision" for m in got) == nnodes)
        first = next(m for m in got if m.KIND == "job_decision")
        assert first.missing == (late,)
        links[1].send(jobwire.NodeVote(token=TOKEN, node_rank=1, topic=topic, round=1, ranks=(late,), values=(value,),
                                       waits=(0.3,)))
        again = _run_root(root, links, lambda got: any(m.KIND == "job_decision" for m in got))
        assert [m for m in again if m.KIND == "job_decision"] == [first]
        assert root.stop is None
    finally:
        _close(ctx, root, links)


def test_a_nodes_join_info_larger_than_the_jobs_table_fails_that_node_naming_the_limit():
    """A node whose ranks' join info alone pass the job's table limit cannot send them: its head failed with an uncaught
    WireError; now it fails the job naming the sizes and what to change."""
    from types import SimpleNamespace

    from tray.errors import WireError
    from tray.launch.node import NodeHead

    failures = []

    def refuse(msg):
        raise WireError("cannot encode node_offers: 1500000 bytes exceeds the limit of 1048576 bytes")

    head = SimpleNamespace(link=SimpleNamespace(send=refuse, limit=1 << 20),
                           offers={r: SimpleNamespace(rank=r, groups={"g": b"x"}) for r in (0, 1)},
                           procs=[SimpleNamespace(rank=0), SimpleNamespace(rank=1)], world_size=4, _t_offered=None,
                           job=SimpleNamespace(token=TOKEN, node_rank=1), _fail=failures.append)
    NodeHead._offers_complete(head, None)  # type: ignore[arg-type]
    assert len(failures) == 1 and failures[0].exit_code == EXIT_HANDSHAKE
    assert failures[0].summary == (
        "node 1: its ranks' join info cannot go to the root (cannot encode node_offers: 1500000 bytes exceeds the "
        "limit of 1048576 bytes); a job of 4 ranks has a table of at most 1048576 B: span fewer groups across nodes "
        "(the manifest's groups), or run fewer ranks per job")


def test_a_head_of_another_protocol_version_is_named_when_the_join_times_out(capsys):
    """A head of another tray release holds the job's token (CURVE passes) but speaks another protocol version: its
    join was refused in silence and the join timed out saying "not started, a wrong root address, or a firewall".
    The root now says at once whose join it cannot read and why, and the timeout names it."""
    import msgpack

    from tray.handshake.wire import PROTOCOL_VERSION

    port = _free_port()
    job, specs, joins = _job_of(2, 1, port)
    ctx = zmq.Context()
    root = Root(ctx, job, local_world_size=1, manifest="m" * 64, backend="host", groups={}, join_timeout_s=1.0)
    head = make_client(ctx, job_keys(TOKEN))
    head.setsockopt(zmq.IDENTITY, b"node-1-4242")
    head.setsockopt(zmq.LINGER, 0)
    head.connect(f"tcp://127.0.0.1:{port}")
    old = {**msgpack.unpackb(joins[1].to_msgpack()), "v": PROTOCOL_VERSION - 1}
    head.send(msgpack.packb(old, use_bin_type=True))
    try:
        _until_stopped(root)
    finally:
        head.close()
        root.close()
        ctx.term()
    assert root.stop is not None and root.stop.exit_code == EXIT_HANDSHAKE
    v = PROTOCOL_VERSION
    assert root.stop.summary.endswith(
        f"the root could not read what 1 head(s) sent: node-1-4242: protocol version {v - 1}, expected {v}; upgrade "
        "tray on node-1-4242 (run one tray version everywhere)"), root.stop.summary
    said = [line for line in capsys.readouterr().err.splitlines() if "cannot read the join" in line]
    assert said == [f"tray: root: cannot read the join of node-1-4242: protocol version {v - 1}, expected {v}; upgrade "
                    "tray on node-1-4242 (run one tray version everywhere)"], said


def test_a_rank_that_left_is_named_from_a_votes_own_step_without_a_pass_over_every_undecided_step(monkeypatch):
    """Once a rank had left (exited 0, closed its tray), every vote made the root copy every undecided step's votes
    (O(ranks of the job) per vote) to find one waiting for it. It now looks at the vote's step alone, through the ranks
    that left: a step of a group without them goes on; a job-wide step stops the job naming the rank; votes held at a
    head count as waiting."""
    from tray.handshake.steps import group_topic

    ctx = zmq.Context()
    root = _joined_root(ctx, 3, 2, groups={"g": ((0, 1), (2, 3), (4, 5))})
    passes = []
    monkeypatch.setattr(root, "_heard", lambda: passes.append(1) or ({}, {}))
    try:
        def vote(node: int, topic: str, ranks: tuple[int, ...]) -> bytes:
            return jobwire.NodeVote(token=TOKEN, node_rank=node, topic=topic, round=1, ranks=ranks,
                                    values=tuple(7 for _ in ranks), waits=tuple(10.0 for _ in ranks)).to_msgpack()

        root._on_message(b"node-0", jobwire.NodeLeft(token=TOKEN, node_rank=0, rank=1, how="exited 0").to_msgpack())
        root._on_message(b"node-1", vote(1, group_topic("g", (2, 3), "barrier"), (2,)))
        root._on_message(b"node-2", jobwire.NodeHeld(token=TOKEN, node_rank=2, topics=("x",), rounds=(1,), ranks=(4,),
                                                     waits=(0.0,)).to_msgpack())
        assert root.stop is None  # rank 1 is not of group g's instance (2, 3); rank 4 held, but gave the step up
        assert passes == []  # (a stop says the steps left pending: one pass then)
        root._on_message(b"node-2", jobwire.NodeHeld(token=TOKEN, node_rank=2, topics=("x",), rounds=(1,), ranks=(4,),
                                                     waits=(10.0,)).to_msgpack())
        assert root.stop is not None
        assert root.stop.summary == "rank 1 exited 0 while rank 4 waits for it in exchange 'x' (round 1), which it " \
            "never joined: every rank must make the same tray-wide steps", root.stop.summary
    finally:
        root.close()
        ctx.term()


def test_the_roots_index_of_held_votes_follows_each_nodes_latest_word():
    """Votes held at a head are indexed by step: a node's NodeHeld replaces what it said before, and its vote in a step
    takes that step's held votes out. A stale entry would count a rank as waiting after it stopped (and stop the job
    when a rank leaves) or hide it."""
    ctx = zmq.Context()
    root = _joined_root(ctx, 2, 2)
    try:
        def held(topics: tuple[str, ...], ranks: tuple[int, ...]) -> bytes:
            return jobwire.NodeHeld(token=TOKEN, node_rank=1, topics=topics, rounds=(1,) * len(topics), ranks=ranks,
                                    waits=(10.0,) * len(topics)).to_msgpack()

        root._on_message(b"node-1", held(("a", "b"), (2, 3)))
        assert {k: sorted(v) for k, v in root._held_at.items()} == {("a", 1): [2], ("b", 1): [3]}
        root._on_message(b"node-1", held(("b",), (3,)))  # rank 2 gave step a up
        assert {k: sorted(v) for k, v in root._held_at.items()} == {("b", 1): [3]}
        root._on_message(b"node-1", jobwire.NodeVote(token=TOKEN, node_rank=1, topic="b", round=1, ranks=(2, 3),
                                                     values=(1, 2), waits=(10.0, 10.0)).to_msgpack())
        assert root._held_at == {} and root.held[1] == {}
        root._on_message(b"node-0", jobwire.NodeLeft(token=TOKEN, node_rank=0, rank=0, how="exited 0").to_msgpack())
        assert root.stop is not None and "while ranks 2,3 wait for it in exchange 'b' (round 1)" in root.stop.summary
    finally:
        root.close()
        ctx.term()


def test_a_vote_after_a_rank_left_stops_the_job_when_its_step_waits_for_that_rank():
    """The same through votes that reach the root: a job-wide step that rank 1 never joins."""
    ctx = zmq.Context()
    root = _joined_root(ctx, 2, 2)
    try:
        root._on_message(b"node-0", jobwire.NodeLeft(token=TOKEN, node_rank=0, rank=1, how="closed its tray")
                         .to_msgpack())
        assert root.stop is None
        root._on_message(b"node-1", jobwire.NodeVote(token=TOKEN, node_rank=1, topic="x", round=1, ranks=(2, 3),
                                                     values=(1, 2), waits=(5.0, 5.0)).to_msgpack())
        assert root.stop is not None and root.stop.rank == 1
        assert "rank 1 closed its tray while ranks 2,3 wait for it in exchange 'x' (round 1)" in root.stop.summary
    finally:
        root.close()
        ctx.term()


def _glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):  # no such name here (not glibc)
        return False


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc only")
def test_the_root_keeps_the_memory_of_a_steps_messages_rather_than_fault_it_in_again_at_every_step(monkeypatch):
    """A job-wide step's decision goes to every node in a buffer of its own (ZeroMQ encrypts each): ~19 MB at 1,000
    nodes of 4, allocated and freed at once, which glibc gave back to the OS and faulted in again at every step (about
    8,200 page faults a step there). The root keeps freed memory up to 64 KiB per node (1 MiB at least, 256 MiB at
    most), and blocks up to its largest message come from glibc's heap; an operator's own malloc settings stand."""
    import subprocess
    import sys

    from tray.launch import root as root_module

    code = """
import resource, sys
from tray.launch.root import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory(64 << 20)
def burst(size):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [bytearray(size) for _ in range((16 << 20) // size)]  # 16 MB at once, freed at once
    del xs
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
print(*[min(burst(size) for _ in range(4)) for size in (16 << 10, 512 << 10)])
"""
    # the allocator as glibc's defaults have it: no operator settings, no other malloc preloaded
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    faults = {how: [int(x) for x in subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True,
                                                    check=True, timeout=60, env=env).stdout.split()]
              for how in ("trim", "keep")}
    if faults["trim"][0] < 1000:  # huge pages, or a malloc that keeps memory anyway: nothing here to compare
        pytest.skip(f"this allocator does not give memory back at each burst ({faults})")
    # 4,000 pages of 4 KiB each time, or next to none; blocks of 512 KiB (mapped by default) too
    assert all(k * 10 < t for k, t in zip(faults["keep"], faults["trim"])), faults
    said = subprocess.run([sys.executable, "-c", "from tray.launch.root import keep_freed_memory; "
                           "print(keep_freed_memory(1 << 20))"], capture_output=True, text=True, check=True, timeout=60,
                          env={**env, "MALLOC_TRIM_THRESHOLD_": "131072"}).stdout.split()
    assert said == ["False"]  # the operator's setting stands
    kept = []
    monkeypatch.setattr(root_module, "keep_freed_memory", lambda n, m: kept.append((n, m)))
    monkeypatch.setattr(root_module, "raise_fd_soft_limit", lambda: (-1, -1))  # whatever this machine's `ulimit -n`
    for nnodes in (2, 100, 10000):
        ctx = zmq.Context()  # one ZAP handler per context
        try:
            Root(ctx, JobSpec(nnodes=nnodes, node_rank=0, root_host="127.0.0.1", root_port=_free_port(), rdzv_id="t",
                              token=TOKEN, source="cli"), local_world_size=1, manifest="m" * 64, backend="host",
                 groups={}, join_timeout_s=1.0).close()
        finally:
            ctx.term()
    assert kept == [(1 << 20, (1 << 20) + (64 << 10)), (100 * 64 << 10, (1 << 20) + (64 << 10)),
                    (256 << 20, 32 << 20)]


def test_heartbeats_are_left_out_while_other_messages_flow(monkeypatch):
    """Any message says its sender is alive: the root leaves out the beat of a node it sent something within the last
    period (less its look interval), and a head its own beat while it sends votes (at 1,000 nodes in lockstep, 2,000
    messages a second each way beside the steps'); a quiet node or head still hears or sends one every period."""
    import types

    from tray.launch import node as node_module
    from tray.launch import root as root_module

    t = [1000.0]  # a clock the test moves: the root's and the head's
    clock = types.SimpleNamespace(monotonic=lambda: t[0], perf_counter=time.perf_counter, thread_time=time.thread_time,
                                  time=time.time, clock_gettime=time.clock_gettime, CLOCK_BOOTTIME=time.CLOCK_BOOTTIME)
    ctx = zmq.Context()
    root = _joined_root(ctx, 4)
    real = root.sock
    sent: list[bytes] = []

    class Fake:
        closed = False

        def send(self, data: bytes, flags: int = 0, copy: bool = True) -> None:
            sent.append(bytes(data))

    root.sock = Fake()  # type: ignore[assignment]
    monkeypatch.setattr(root_module, "time", clock)
    try:
        for n in range(4):
            root.nodes[n].last_seen = t[0]
        for n, ago in enumerate((0.0, 0.3, 0.4, 2.0)):
            root.nodes[n].last_sent = t[0] - ago
        root._beats_looked_at = 0.0
        root.tick()
        assert [d for d in sent if d.startswith(b"node-")] == [b"node-2", b"node-3"], sent
        sent.clear()
        t[0] += 0.06  # within the look interval: no look
        root.tick()
        assert sent == [], sent
        t[0] += 0.06  # node 1 now quiet for 0.42 s: its beat goes, so it hears the root every 0.5 s at most
        root.tick()
        assert [d for d in sent if d.startswith(b"node-")] == [b"node-1"], sent
    finally:
        root.sock = real
        root.close()
    spec = JobSpec(nnodes=2, node_rank=1, root_host="127.0.0.1", root_port=_free_port(), rdzv_id="test", token=TOKEN,
                   source="cli")
    join = jobwire.NodeJoin(token=TOKEN, node_rank=1, nnodes=2, local_world_size=1, rdzv_id="test", hostname="h",
                            pid=9, manifest="m" * 64, backend="host")
    link = NodeLink(ctx, spec, join, 30.0)
    real = link.sock
    kinds: list[str] = []

    class Recorder(Fake):
        def send(self, data: bytes, flags: int = 0, copy: bool = True) -> None:
            kinds.append(jobwire.decode(data, token=TOKEN).KIND)

    link.sock = Recorder()  # type: ignore[assignment]
    monkeypatch.setattr(node_module, "time", clock)
    try:
        link.last_heard = t[0]
        link.send(jobwire.NodeVote(token=TOKEN, node_rank=1, topic="x", round=1, ranks=(1,), values=(1,),
                                   waits=(5.0,)))
        t[0] += 0.45  # a vote 0.45 s ago: no beat yet
        link.last_heard = t[0]
        assert link.tick() is None and kinds == ["node_vote"], kinds
        t[0] += 0.05  # 0.5 s quiet: the beat goes
        assert link.tick() is None and kinds == ["node_vote", "beat"], kinds
    finally:
        link.sock = real
        link.close()
        ctx.term()


def test_a_head_restarted_on_the_right_release_is_not_blamed_when_another_node_never_joins():
    """Node 1's head first ran another release (its join unreadable), then joined from a new process; node 2 never
    came: the join's timeout names node 2 as not started, not node 1's earlier head."""
    spec = JobSpec(nnodes=3, node_rank=0, root_host="127.0.0.1", root_port=_free_port(), rdzv_id="test", token=TOKEN,
                   source="cli")
    ctx = zmq.Context()
    root = Root(ctx, spec, local_world_size=1, manifest="m" * 64, backend="host", groups={}, join_timeout_s=0.0)
    try:
        root._on_message(b"node-1-4242", b"\x81\xa4kind\xa4join")  # unreadable: said, and kept for the timeout
        assert b"node-1-4242" in root.unjoined
        for n in (0, 1):
            join = jobwire.NodeJoin(token=TOKEN, node_rank=n, nnodes=3, local_world_size=1, rdzv_id="test",
                                    hostname="h", pid=100 + n, manifest="m" * 64, backend="host")
            root._on_message(f"node-{n}-{100 + n}".encode(), join.to_msgpack())
        root.tick()
    finally:
        root.close()
        ctx.term()
    assert root.stop is not None and "node(s) 2 did not join" in root.stop.summary, root.stop
    assert "could not read" not in root.stop.summary and root.stop.summary.endswith("or a firewall"), root.stop.summary
