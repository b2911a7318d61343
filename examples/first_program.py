"""A first tray program: buffers, peer tables, a kernel that writes into every peer, barrier, read/write,
a peer's buffer as an array, exchange.

Run: tray launch -n 2 --backend host --manifest examples/first_program.json examples/first_program.py

Every rank owns `inbox` (u32[world_size, words], exported) and maps every peer's `inbox`. The manifest
kernel `peer_fill` writes rank r's pattern into row r of every member's inbox, through the peer table;
after a barrier each rank checks every row of its own inbox. On the host backend the kernel is a numpy
twin (registered by the backend itself, see tray.twins); on cuda it is kernels/peer_fill.cu beside this file
(a copy of the built-in one, so that examples/ runs wherever it is copied).
`rank.peer_view(name, member)` is member's buffer as mapped here, usable without a copy by numpy
(`np.asarray` on the host backend) or torch/cupy (`from_dlpack`, on this GPU on cuda).
"""

import numpy as np

import tray
from tray.backend.host.twins import peer_fill_words  # the reference pattern (numpy, any backend)

SEED = 7

with tray.init() as rank:  # blocks until every rank has mapped every peer's buffers
    me, n = rank.rank, rank.world_size
    inbox = rank.buffer("inbox")  # Buffer(name, dtype "u32", shape (n, words), nbytes, ptr, export)
    words = inbox.shape[1]
    peers = rank.peers("inbox")  # PeerTable: ptrs[g] = member g's inbox as mapped here; table_ptr: u64[n]
    assert peers.ptrs[me] == inbox.ptr and len(peers.ptrs) == n

    # A kernel with "peers": true gets the device table of peer addresses as its first argument.
    rank.kernel("peer_fill").launch((1, 1, 1), (128, 1, 1), [peers.table_ptr, n, me, words, SEED])
    rank.barrier()  # every rank wrote every inbox; BarrierTimeout would name a missing rank

    got = rank.read("inbox")  # a host copy, u32[n, words]
    for writer in range(n):
        assert (got[writer] == peer_fill_words(SEED, writer, me, words)).all(), f"row {writer}"

    nxt = (me + 1) % n
    theirs = rank.peer_view("inbox", nxt)  # rank nxt's inbox, mapped into this process: no copy
    if rank.backend.name == "host":  # host memory: numpy reads it in place (cuda: torch.from_dlpack(theirs))
        assert (np.asarray(theirs)[me] == peer_fill_words(SEED, me, nxt, words)).all(), "my row over there"

    rank.write("scratch", np.arange(words, dtype=np.float32) * me)  # host -> this rank's buffer
    total = float(rank.read("scratch").sum())
    totals = rank.exchange("scratch-sum", total)  # every rank's value, in rank order, through the head
    assert totals == [float(np.arange(words).sum() * r) for r in range(n)]
    print(f"rank {me}: {n} rows of {words} words from {n} writers checked; totals {totals}")
