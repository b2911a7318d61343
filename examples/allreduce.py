"""Collectives: allreduce and allgather over the world group, allreduce inside pairs of ranks.

Run: tray launch -n 2 --backend host --manifest examples/allreduce.json examples/allreduce.py

`rank.collectives(group)` is NCCL on cuda and shared-memory algorithms over the peer-mapped buffers on
the host backend; the calls are the same: (send_ptr, recv_ptr, count, dtype), count in elements per
rank (NCCL's convention). The group `pairs` ({0,1}, {2,3}, ...) needs an even number of ranks.
"""

import numpy as np

import tray

with tray.init() as rank:
    me, n = rank.rank, rank.world_size
    send, recv = rank.buffer("send"), rank.buffer("recv")
    count = send.shape[0]  # world_size * count elements
    inputs = [np.random.default_rng(r).standard_normal(count).astype(np.float32) for r in range(n)]
    rank.write("send", inputs[me])

    world = rank.collectives("world")
    world.allreduce(send.ptr, recv.ptr, count, "f32")
    want = inputs[0].copy()
    for r in range(1, n):  # the host backend sums in rank order: the result is exact, not just close
        want += inputs[r]
    assert np.array_equal(rank.read("recv"), want)

    per_rank = count // n
    world.allgather(send.ptr, recv.ptr, per_rank, "f32")  # everyone's first per_rank elements, rank order
    assert np.array_equal(rank.read("recv"), np.concatenate([x[:per_rank] for x in inputs]))

    pair = rank.group("pairs")  # GroupInfo: members (global ranks), index (mine among them)
    rank.collectives("pairs").allreduce(send.ptr, recv.ptr, count, "f32")
    assert np.allclose(rank.read("recv"), sum(inputs[m] for m in pair.members))
    rank.barrier("pairs")
    print(f"rank {me}: allreduce, allgather over {n} ranks and allreduce over pair {pair.members} checked")
