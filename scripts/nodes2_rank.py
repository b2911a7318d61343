"""A rank of the two-node GPU check (scripts/gpu-nodes2.sh): barriers over the job-wide group (it spans both
nodes) and over the node-local pairs, an NCCL allreduce over the whole job, checked; writes rank-R.json.

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


def timed(fn, iters: int) -> float:
    """Median seconds of `fn()` over `iters` calls."""
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


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
        try:                                                  # a spanning group has no peer table
            rank.peers("fill")
            report["peers_world"] = "present"
        except tray.UsageError as exc:
            report["peers_world"] = str(exc)
        rank.barrier()
        (out / f"rank-{me}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
