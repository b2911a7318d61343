"""The job's root at hundreds of nodes, on one machine: a real root (tray.launch.root.Root, driven as node 0's head
drives it: a poll loop with its tick every 20 ms) in one process, and N nodes' links to it (tray.launch.node.NodeLink:
CURVE over TCP, the heads' own heartbeat rule) in another, without ranks. Each node joins, sends the offers of its L
ranks (CUDA-shaped: two fabric-exported buffers; rank 0 carries a 128-byte NCCL id: what a node sends of them, their
join info), says ready, votes in ITERS job-wide steps, idles for IDLE seconds and says done.

Measured, per job size: join (every link created -> every node acknowledged), table (every node's offers sent ->
every node holds the table; then, timed apart, node 0's head making its ranks' table of it and a rank decoding that),
go, each step (every vote sent -> every node holds the decision; the decisions are
received as bytes, node 0's and one other's decoded and checked: decoding thousands of tables and decisions in the
one process of all nodes would time the bench, not the root), the messages each way and the root's CPU per phase,
and while idle the messages per second each way. The links' process costs CPU too: on a machine of few cores the
figures include the root waiting for a core.

    python bench/root_scale.py --nodes 100,250,500,1000 [-L 4] [--iters 20] [--idle-s 5] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import secrets
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import zmq

from tray.bench.nodes import free_port
from tray.envinfo import environment
from tray.handshake import jobwire, raise_fd_soft_limit, wire
from tray.launch.job import JobSpec

MANIFEST = "a" * 64
MARK_WAIT_S = 30.0  # the root's acknowledgement of a phase's mark, at most
TICK_S = 0.020  # the head's supervision period (tray/launch/head.py _POLL_MS)


def _job(nnodes: int, node_rank: int, port: int, token: str, timeout_s: float) -> JobSpec:
    return JobSpec(nnodes=nnodes, node_rank=node_rank, root_host="127.0.0.1", root_port=port, rdzv_id="scale",
                   token=token, source="cli", node_heartbeat_timeout_s=timeout_s)


# --- the root's process ------------------------------------------------------------------------------------
def serve_root(nnodes: int, local: int, port: int, deadline_s: float, heartbeat_timeout_s: float) -> None:
    """Run a root until the job ends or stops; print its counters over time as JSON on stdout."""
    from tray.launch.root import Root

    token = os.environ["TRAY_JOB_TOKEN"]
    ctx = zmq.Context()
    # one group over the whole job, which spans its nodes: its leaders' NCCL id (rank 0's) is the table's
    root = Root(ctx, _job(nnodes, 0, port, token, heartbeat_timeout_s), local_world_size=local, manifest=MANIFEST,
                backend="cuda", groups={"world": (tuple(range(nnodes * local)),)}, join_timeout_s=deadline_s)
    print(json.dumps({"listening": True}), flush=True)
    poller = zmq.Poller()
    marks_in = sys.stdin.fileno()  # the nodes' process names each phase's start and end here, and waits for "ok"
    poller.register(marks_in, zmq.POLLIN)
    for s in root.sockets():
        poller.register(s, zmq.POLLIN)
    marks: dict[str, tuple] = {}
    pending = b""
    next_turn = 0.0
    end = time.monotonic() + deadline_s
    try:
        while not root.ended and root.stop is None and time.monotonic() < end:
            ready = dict(poller.poll(max(0, math.ceil((next_turn - time.monotonic()) * 1000))))
            # NOTE: a mark before the messages of this turn: a phase's first message, sent after its start was
            # acknowledged, counts in it; its end is marked once every node received what the phase ends with
            if marks_in in ready:
                pending += os.read(marks_in, 4096)
                while b"\n" in pending:
                    name, _, pending = pending.partition(b"\n")
                    marks[name.decode()] = (root.messages_in, root.messages_out, root.busy_cpu_s, time.process_time(),
                                            resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
                    os.write(sys.stdout.fileno(), b"ok\n")
            for s in root.sockets():
                if s in ready:
                    root.on_readable(s)
            now = time.monotonic()
            if now >= next_turn:
                next_turn = now + TICK_S
                root.tick()
        print(json.dumps({"marks": marks, "ended": root.ended, "stop": root.stop.summary if root.stop else None,
                          "rejects": root.rejected[:5], "summary": root.summary()}), flush=True)
    finally:
        root.close()
        ctx.term()


# --- the nodes' process ------------------------------------------------------------------------------------
# NOTE: protocol 8 sends the root the join info of a node's offers and every node the job's (tray/launch/root.py);
# before it the whole offers went to the root and every node got every rank's offer. Both are driven here, to compare
JOINS_TABLE = "joins" in {f.name for f in dataclasses.fields(jobwire.NodeOffers)}


def _node_offers(token: str, node: int, offers: list[wire.Offer]) -> jobwire.NodeOffers:
    if JOINS_TABLE:
        return jobwire.NodeOffers(token=token, node_rank=node, joins=wire.joins_of(offers))
    return jobwire.NodeOffers(token=token, node_rank=node, offers=tuple(offers))  # type: ignore[call-arg]


def _ranks_table(frames: list[bytes], mine: list[wire.Offer], local: int, world: int, token: str) -> dict:
    """What node 0's head then does with the table as tray/launch/node.py does (inflate and decode it, build its ranks'
    table, encode it once) and what each of its ranks does (decode that), medians of 5 in ms, and that table's bytes."""
    limit = wire.job_message_limit(world)
    head, rank = [], []
    for _ in range(5):
        t = time.perf_counter()
        job = jobwire.decode(jobwire.message_of(frames, limit), token=token, sender="root", limit=limit)
        if JOINS_TABLE:
            table = wire.Table(token=token, offers=tuple(mine),
                               joins={r: v for r, v in job.joins.items() if not 0 <= r < local})
        else:
            table = wire.Table(token=token, offers=tuple(job.offers))
        data = wire.encode(table, limit)
        t1 = time.perf_counter()
        wire.decode(data, token=token, limit=limit)
        head.append(t1 - t)
        rank.append(time.perf_counter() - t1)
    return {"head_ms": round(statistics.median(head) * 1e3, 2), "rank_ms": round(statistics.median(rank) * 1e3, 2),
            "bytes": len(data)}


def _offer(rank: int, world: int, local: int, token: str) -> wire.Offer:
    """A CUDA rank's offer as a real one is shaped: its GPU, two fabric-exported buffers, an NCCL id at rank 0."""
    dev = wire.DeviceIdentity(ordinal=rank % local, uuid=f"GPU-{rank:08x}-1c2d-3e4f-5a6b-7c8d9e0f1a2b",
                              pci_bus=f"0000:{0x18 + rank % local:02x}:00.0", numa_node=rank % local // 2)
    bufs = tuple(wire.BufferOffer(name=n, nbytes=nb, handle="fabric", fabric=secrets.token_bytes(64))
                 for n, nb in (("x", 1 << 26), ("flags", 1 << 12)))
    return wire.Offer(token=token, rank=rank, world_size=world, host=f"boot-{rank // local:06d}", pid=1000 + rank,
                      uid=1000, device=dev, backend="cuda", manifest=MANIFEST,
                      fd_socket=f"/tmp/tray-jobs.1000/job-0123456789ab/rank-{rank}.fds", buffers=bufs,
                      groups={"tray:leaders:world": secrets.token_bytes(128)} if rank == 0 else {},
                      timings={"import": 0.31, "manifest": 0.01, "device": 0.12, "allocate": 0.02, "offer": 0.0})


class Nodes:
    """N NodeLinks in one process, received as bytes."""

    def __init__(self, nnodes: int, local: int, port: int, token: str, timeout_s: float) -> None:
        from tray.launch.node import NodeLink

        self.nnodes, self.local, self.token = nnodes, local, token
        raise_fd_soft_limit()  # a socket, its monitor and a connection per node
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 4 * nnodes + 64)  # a DEALER and its monitor's two PAIRs per node
        t0 = time.monotonic()
        self.links = []
        for n in range(nnodes):
            join = jobwire.NodeJoin(token=token, node_rank=n, nnodes=nnodes, local_world_size=local, rdzv_id="scale",
                                    hostname=f"node-{n:04d}", pid=10_000 + n, manifest=MANIFEST, backend="cuda")
            self.links.append(NodeLink(self.ctx, _job(nnodes, n, port, token, timeout_s), join, 600.0))
        self.t_joins_sent = time.monotonic()
        self.t0 = t0
        self.poller = zmq.Poller()
        self.index = {}
        for i, link in enumerate(self.links):
            self.poller.register(link.sock, zmq.POLLIN)
            self.index[link.sock] = i
        self.received = 0
        self.beats_in = 0

    def tick(self) -> None:
        for link in self.links:
            reason = link.tick()
            if reason is not None:
                raise RuntimeError(f"node {link.job.node_rank}: {reason}")

    def wait_all(self, kind: str, timeout_s: float) -> tuple[float, list[list[bytes]]]:
        """Until every node received a message of `kind` (its first is kept); beats are counted and the links tick
        as the heads' do. Returns when the last one came, and each node's message as its frames."""
        got: list[list[bytes] | None] = [None] * self.nnodes
        left = self.nnodes
        end = time.monotonic() + timeout_s
        next_tick = 0.0
        last = time.monotonic()
        while left:
            now = time.monotonic()
            if now > end:
                missing = [i for i, g in enumerate(got) if g is None]
                raise RuntimeError(f"{len(missing)} node(s) got no {kind} within {timeout_s:g} s: {missing[:10]}")
            if now >= next_tick:
                next_tick = now + TICK_S
                self.tick()
            for sock, _ in self.poller.poll(int(TICK_S * 1000)):
                i = self.index[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.links[i].last_heard = time.monotonic()
                    self.received += 1
                    k = _kind(frames)
                    if k == "beat":
                        self.beats_in += 1
                    if k == "job_stop":
                        stop = jobwire.decode(jobwire.message_of(frames, self.links[i].limit), token=self.token)
                        raise RuntimeError(f"the root stopped the job: {stop.summary}")
                    if k == kind and got[i] is None:
                        got[i] = frames
                        left -= 1
                        last = time.monotonic()
        return last, got  # type: ignore[return-value]

    def idle(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        next_tick = 0.0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                self.tick()
            for sock, _ in self.poller.poll(int(TICK_S * 1000)):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.links[self.index[sock]].last_heard = time.monotonic()
                    self.received += 1
                    self.beats_in += _kind(frames) == "beat"

    def sent(self) -> int:
        return sum(link._seq for link in self.links)  # beats sent so far

    def close(self) -> None:
        for link in self.links:
            link.close(linger_ms=0)
        self.ctx.term()


def _kind(frames: list[bytes]) -> str:
    # NOTE: a job message is a msgpack map whose "kind" entry comes first (tray/handshake/wire.py _Message.to_body):
    # read it without decoding the rest (a table of thousands of offers), inflating only its start when the root
    # deflated it (jobwire.frames_of): the one process of every node would otherwise time inflating N tables
    import zlib

    import msgpack

    data = frames[0] if len(frames) == 1 else zlib.decompressobj().decompress(frames[1], 256)
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data[:256])
    try:
        unpacker.read_map_header()
        while True:
            key = unpacker.unpack()
            value = unpacker.unpack()
            if key == "kind":
                return value
    except (ValueError, msgpack.OutOfData):
        pass
    raise RuntimeError(f"a message from the root without its kind first: {data[:64]!r}")


def run(nnodes: int, local: int, iters: int, idle_s: float, timeout_s: float) -> dict:
    token = secrets.token_hex(32)
    port = free_port()
    env = dict(os.environ, TRAY_JOB_TOKEN=token)
    root = subprocess.Popen([sys.executable, __file__, "--serve-root", str(nnodes), str(local), str(port),
                             str(timeout_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            cwd=str(REPO))
    marks: dict[str, float] = {}

    def mark(name: str, t: float | None = None) -> None:
        """A phase's start or end, at `t` (now): the root records its counters before its next messages."""
        marks[name] = time.monotonic() if t is None else t
        root.stdin.write(name + "\n")
        root.stdin.flush()
        # NOTE: the root reads marks at every turn of its loop (20 ms at most): one unanswered this long is stuck
        if not select.select([root.stdout], [], [], MARK_WAIT_S)[0]:
            raise RuntimeError(f"the root's process (pid {root.pid}) did not acknowledge mark {name!r} within "
                               f"{MARK_WAIT_S:g} s")
        if root.stdout.readline() != "ok\n":
            raise RuntimeError(f"the root's process (pid {root.pid}) ended before acknowledging mark {name!r}")

    try:
        line = root.stdout.readline()
        if not line:
            raise RuntimeError("the root's process exited before listening")
        mark("t0")
        nodes = Nodes(nnodes, local, port, token, timeout_s=60.0)
        try:
            marks["joins_sent"] = nodes.t_joins_sent
            mark("joined", nodes.wait_all("beat", timeout_s)[0])
            world = nnodes * local
            offers = [_offer(r, world, local, token) for r in range(world)]
            mark("offers_from")
            for n, link in enumerate(nodes.links):
                link.send(_node_offers(token, n, offers[n * local:(n + 1) * local]))
            marks["offers_sent"] = time.monotonic()
            t, tables = nodes.wait_all("job_table", timeout_s)
            mark("table", t)
            limit = wire.job_message_limit(world)
            table_bytes = jobwire.message_of(tables[-1], limit)
            table = jobwire.decode(table_bytes, token=token, sender="root", limit=limit)
            if JOINS_TABLE:
                assert table.joins == wire.joins_of(offers), "the table is not the job's join info"
            else:
                assert table.offers == tuple(offers), "the table is not every rank's offer in rank order"
            ranks_table = _ranks_table(tables[0], offers[:local], local, world, token)
            mark("ready_from")
            for n, link in enumerate(nodes.links):
                link.send(jobwire.NodeReady(token=token, node_rank=n, timings={"ready": 1.0}))
            mark("go", nodes.wait_all("job_go", timeout_s)[0])
            steps = []
            mark("steps_from")
            for k in range(iters):
                t = time.monotonic()
                for n, link in enumerate(nodes.links):
                    ranks = tuple(range(n * local, (n + 1) * local))
                    link.send(jobwire.NodeVote(token=token, node_rank=n, topic="step", round=k, ranks=ranks,
                                               values=tuple(r * 1000 + k for r in ranks), waits=(60.0,) * local))
                sent = time.monotonic()
                last, got = nodes.wait_all("job_decision", timeout_s)
                for i in (0, nnodes - 1):
                    d = jobwire.decode(jobwire.message_of(got[i], limit), token=token, sender="root", limit=limit)
                    assert d.round == k and d.values == tuple(r * 1000 + k for r in range(world)), "a wrong decision"
                steps.append({"send_s": sent - t, "decided_s": last - sent,
                              "bytes": len(jobwire.message_of(got[0], limit)), "wire_bytes": len(got[0][-1])})
            mark("steps_to")
            received0, beats0 = nodes.received, nodes.beats_in
            sent0 = nodes.sent()
            mark("idle_from")
            nodes.idle(idle_s)
            mark("idle_to")
            idle = {"root_to_nodes_per_s": (nodes.received - received0) / idle_s,
                    "beats_root_to_nodes_per_s": (nodes.beats_in - beats0) / idle_s,
                    "beats_nodes_to_root_per_s": (nodes.sent() - sent0) / idle_s}
            for n, link in enumerate(nodes.links):
                link.send(jobwire.NodeDone(token=token, node_rank=n))
            marks["end"], _ = nodes.wait_all("job_end", timeout_s)
        finally:
            nodes.close() if "nodes" in locals() else None
        out, _ = root.communicate(timeout=timeout_s)  # closes its stdin
    finally:
        if root.poll() is None:
            root.kill()
            root.wait()
    result = json.loads(out.strip().splitlines()[-1])
    if not result["ended"]:
        raise RuntimeError(f"the root did not end the job: {result}")
    counted = result["marks"]

    def between(a: str, b: str) -> dict:
        i0, o0, c0, p0, f0 = counted[a]
        i1, o1, c1, p1, f1 = counted[b]
        return {"messages_in": i1 - i0, "messages_out": o1 - o0, "cpu_ms": round((c1 - c0) * 1e3, 2),
                "cpu_us_per_message_in": round((c1 - c0) * 1e6 / max(1, i1 - i0), 1),
                # with ZeroMQ's I/O thread (CURVE encryption, TCP) and the ZAP handler's
                "process_cpu_ms": round((p1 - p0) * 1e3, 2),
                "page_faults": f1 - f0}  # the root's process's minor faults: memory given back and taken again

    decided = sorted(s["decided_s"] for s in steps)
    idle_root = between("idle_from", "idle_to")
    span = marks["idle_to"] - marks["idle_from"]
    return {
        "nnodes": nnodes, "local": local, "world_size": nnodes * local,
        "join_s": round(marks["joined"] - marks["t0"], 3),
        "links_created_s": round(marks["joins_sent"] - marks["t0"], 3),
        "table_s": round(marks["table"] - marks["offers_from"], 3),
        "table_bytes": len(table_bytes),
        "table_wire_bytes": len(tables[0][-1]),  # as sent: deflated when the root deflates it
        "ranks_table": ranks_table,
        "go_s": round(marks["go"] - marks["ready_from"], 3),
        "step_ms": {"median": round(statistics.median(decided) * 1e3, 2),
                    "p90": round(decided[int(0.9 * (len(decided) - 1))] * 1e3, 2),
                    "votes_sent_median": round(statistics.median(s["send_s"] for s in steps) * 1e3, 2),
                    "decision_bytes": steps[0]["bytes"], "decision_wire_bytes": steps[0]["wire_bytes"]},
        "root": {"join": between("t0", "joined"),
                 "table": between("offers_from", "table"),
                 "go": between("ready_from", "go"),
                 "steps": between("steps_from", "steps_to"),
                 "cpu_ms_per_step": round(between("steps_from", "steps_to")["cpu_ms"] / iters, 2),
                 "process_cpu_ms_per_step": round(between("steps_from", "steps_to")["process_cpu_ms"] / iters, 2),
                 "page_faults_per_step": round(between("steps_from", "steps_to")["page_faults"] / iters),
                 "idle": {"messages_in_per_s": round(idle_root["messages_in"] / span, 1),
                          "messages_out_per_s": round(idle_root["messages_out"] / span, 1),
                          "cpu_ms_per_s": round(idle_root["cpu_ms"] / span, 2)},
                 "summary": result["summary"]},
        "idle_seen_by_nodes": {k: round(v, 1) for k, v in idle.items()},
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-root":
        n, local, port, deadline = sys.argv[2:6]
        profile = os.environ.get("ROOT_SCALE_PROFILE")
        if profile:  # where the root's time goes: cProfile's stats, written when it ends
            import cProfile

            cProfile.runctx("serve_root(int(n), int(local), int(port), float(deadline), heartbeat_timeout_s=60.0)",
                            globals(), locals(), f"{profile}-{n}.prof")
        else:
            serve_root(int(n), int(local), int(port), float(deadline), heartbeat_timeout_s=60.0)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="100,250,500,1000", help="job sizes in nodes, comma-separated")
    p.add_argument("-L", type=int, default=4, help="ranks per node (default 4)")
    p.add_argument("--iters", type=int, default=20, help="job-wide steps per size (default 20)")
    p.add_argument("--idle-s", type=float, default=5.0, help="seconds of idle traffic measured (default 5)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="give up on a phase after this (default 300)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--profile", metavar="PREFIX", help="profile the root (cProfile) into PREFIX-NODES.prof")
    a = p.parse_args()
    sizes = [int(x) for x in a.nodes.split(",")]
    if a.profile:
        os.environ["ROOT_SCALE_PROFILE"] = a.profile
    if any(n < 1 for n in sizes) or a.L < 1 or a.iters < 1 or a.idle_s <= 0:
        p.error("--nodes, -L and --iters take positive integers, --idle-s a positive time")
    runs = []
    for n in sizes:
        t = time.monotonic()
        r = run(n, a.L, a.iters, a.idle_s, a.timeout_s)
        runs.append(r)
        print(f"{n} nodes x {a.L}: join {r['join_s']:.2f} s, table {r['table_s']:.2f} s ({r['table_bytes']} B, "
              f"{r['table_wire_bytes']} B sent; a head {r['ranks_table']['head_ms']:.1f} ms on it, a rank "
              f"{r['ranks_table']['rank_ms']:.1f} ms on its {r['ranks_table']['bytes']} B), "
              f"go {r['go_s']:.3f} s, step {r['step_ms']['median']:.1f} ms (p90 {r['step_ms']['p90']:.1f}), "
              f"root CPU {r['root']['cpu_ms_per_step']:.1f} ms/step, table {r['root']['table']['cpu_ms']:.0f} ms "
              f"({r['root']['table']['process_cpu_ms']:.0f} ms with I/O); "
              f"idle: root in/out "
              f"{r['root']['idle']['messages_in_per_s']:.0f}/{r['root']['idle']['messages_out_per_s']:.0f} msg/s, "
              f"{r['root']['idle']['cpu_ms_per_s']:.1f} ms CPU/s  [{time.monotonic() - t:.0f} s]", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"env": environment(), "L": a.L, "iters": a.iters, "idle_s": a.idle_s,
                                            "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
