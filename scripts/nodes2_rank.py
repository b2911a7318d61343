"""A rank of the two-node GPU check (scripts/gpu-nodes2.sh): barriers over the job-wide group (it spans both
nodes) and over the node-local pairs, an NCCL allreduce over the whole job, checked; writes rank-R.json.

The spanning barrier is timed on the path it runs (`span_barrier_path`: "hierarchical", the node-local peer
barrier + an NCCL step among the node leaders, or "relayed" through the root where no NCCL was offered):
eager (K launches back to back, device events, / K), eager-sync (launch + synchronise, host clock) and
captured (a graph of K, replayed), each next to the relayed barrier of the same group in the same run
(`span_relayed_us`, host clock per barrier), as ratios relayed / path.

    tray launch --nnodes 2 ... --manifest manifests/peer_fill.json -- python scripts/nodes2_rank.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

import tray

ITERS = 200
SPAN_ITERS = 100   # barriers per eager loop and per graph
SPAN_REPEATS = 5
TIMEOUT_S = 2.0


def timed(fn, iters: int) -> float:
    """Median seconds of `fn()` over `iters` calls."""
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def device_us(rank, barrier, launch, iters: int) -> float:
    """Device µs per barrier of `launch()` (which enqueues `iters` barriers), by the backend's timer."""
    timer = rank.backend.timer()
    timer.start()
    launch()
    timer.stop()
    elapsed = timer.elapsed_s()
    barrier.synchronize()
    barrier.check()
    return elapsed / iters * 1e6


def span_figures(rank) -> dict:
    """The spanning barrier ("world") on its path and relayed, same run; medians over SPAN_REPEATS."""
    barrier = rank.barrier_of("world")
    out: dict = {"span_barrier_path": barrier.path}
    relayed = getattr(barrier, "relayed", None) or barrier
    out["span_relayed_us"] = timed(lambda: relayed.wait(TIMEOUT_S), ITERS) * 1e6
    if barrier.path != "hierarchical":
        return out
    for _ in range(20):
        barrier.wait(TIMEOUT_S)

    def burst() -> None:
        for _ in range(SPAN_ITERS):
            barrier.launch(TIMEOUT_S)

    eager = [device_us(rank, barrier, burst, SPAN_ITERS) for _ in range(SPAN_REPEATS)]
    eager_sync = timed(lambda: barrier.wait(TIMEOUT_S), ITERS) * 1e6
    graph = rank.backend.capture(burst)
    try:
        graph.replay()  # warm: uploads the graph
        barrier.synchronize()
        barrier.check()
        captured = [device_us(rank, barrier, graph.replay, SPAN_ITERS) for _ in range(SPAN_REPEATS)]
    finally:
        graph.close()
    out.update({"span_eager_us": sorted(eager)[len(eager) // 2], "span_eager_sync_us": eager_sync,
                "span_captured_us": sorted(captured)[len(captured) // 2],
                "span_eager_us_all": eager, "span_captured_us_all": captured})
    for key in ("eager", "eager_sync", "captured"):
        out[f"span_relayed_over_{key}"] = out["span_relayed_us"] / out[f"span_{key}_us"]
    return out


def main() -> None:
    out = Path(sys.argv[1])
    with tray.init() as rank:
        me, n = rank.rank, rank.world_size
        rank.barrier()                                        # world spans the nodes
        count = 1024
        rank.write("send", np.full(count, me + 1, np.float32))
        send, recv = rank.buffer("send"), rank.buffer("recv")
        world = rank.collectives("world")
        world.allreduce(send.ptr, recv.ptr, count, "f32")     # NCCL over both nodes (ids through the root)
        rank.synchronize()
        got = rank.read("recv")[:count]
        want = n * (n + 1) / 2
        assert (got == want).all(), (got[:4], want)
        pairs = rank.group("pairs")
        report = {
            "rank": me, "world_size": n, "node_rank": rank.env.node_rank, "pairs": list(pairs.members),
            "allreduce_ok": True,
            "barrier_world_us": timed(lambda: rank.barrier(), ITERS) * 1e6,
            "barrier_pairs_us": timed(lambda: rank.barrier("pairs"), ITERS) * 1e6,
        }
        report.update(span_figures(rank))
        try:                                                  # a spanning group has no peer table
            rank.peers("fill")
            report["peers_world"] = "present"
        except tray.UsageError as exc:
            report["peers_world"] = str(exc)
        rank.barrier()
        (out / f"rank-{me}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
