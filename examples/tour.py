# tour.py, started as: tray launch -n 4 --manifest examples/tour.json examples/tour.py
import numpy as np

import tray

with tray.init() as rank:                   # blocks until every rank is up
    fill = rank.buffer("fill")              # .ptr, .nbytes, .dtype, .shape
    peers = rank.peers("fill")              # every member's address, member order; .table_ptr: device u64[G]
    rank.barrier()                          # BarrierTimeout names the missing rank
    x = rank.read("fill")                   # host copy, typed and shaped: u32[world_size * words]
    src, dst = rank.buffer("src"), rank.buffer("dst")
    rank.write("src", np.full(src.shape, rank.rank + 1, np.float32))
    rank.collectives("world").allreduce(src.ptr, dst.ptr, src.shape[0], "f32")
    assert (rank.read("dst") == sum(range(1, rank.world_size + 1))).all()
    values = rank.exchange("topic", 42)     # every rank's value, through the head
    rank.run("step")                        # a manifest program (launch/nccl/gemm/barrier/copy), in lockstep
    rank.synchronize()                      # raises BarrierTimeout naming who was missing
    session = rank.lease(pages=12)          # state pages (manifest `states`) on this rank
    parked = rank.park(session)             # tray-wide, all or nothing (NoRoom: nothing moved anywhere)
    session = rank.wake(parked)
    print(f"rank {rank.rank}: tour ok ({len(peers.ptrs)} peers, {x.nbytes} B read, exchange {values})")
