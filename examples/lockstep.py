"""A manifest program run in lockstep: out = allreduce(x @ w^T) over every rank, replayed, then captured.

Run: tray launch -n 2 --backend host --manifest examples/lockstep.json examples/lockstep.py

Any -n works; the check's bound grows with it (bf16 rounding at each addition of the allreduce).

`rank.run("layer")` resolves the program's ops once (buffer addresses, sizes, groups) and replays them;
every rank runs the same manifest (the head checked the digest), so every rank runs the same ops in the
same order. `layer_captured` has "graph": true: on cuda it is one CUDA graph replayed; the host backend
replays the same steps. `tray inspect examples/lockstep.json -n 2` prints what the manifest resolves to.
"""

import ml_dtypes
import numpy as np

import tray

bf16 = ml_dtypes.bfloat16

with tray.init() as rank:
    me, n = rank.rank, rank.world_size
    m, k = rank.buffer("x").shape
    xs = [np.random.default_rng(10 + r).standard_normal((m, k)).astype(bf16) for r in range(n)]
    w = np.random.default_rng(99).standard_normal(rank.buffer("w").shape).astype(bf16)  # same on all ranks
    rank.write("x", xs[me])
    rank.write("w", w)

    for _ in range(3):  # resolved once, replayed
        rank.run("layer")
    rank.synchronize()  # raises BarrierTimeout if a barrier in the program timed out
    out = rank.read("out").astype(np.float32)

    # every rank's partial product in float32, rounded to bf16 as the gemm writes it, summed; the allreduce sums in
    # bf16, rounding after each of its n - 1 additions (bf16's unit roundoff is 2**-8), so each element may be off by
    # up to (n - 1) * 2**-8 * the sum of its terms' magnitudes (a rank's partial left out is off by that partial)
    partials = [(x.astype(np.float32) @ w.astype(np.float32).T).astype(bf16).astype(np.float32) for x in xs]
    want = sum(partials)
    bound = max(n - 1, 1) * 2.0**-8 * sum(np.abs(p) for p in partials) + 1e-6
    assert (np.abs(out - want) <= bound).all(), float((np.abs(out - want) / bound).max())

    rank.run("layer_captured")
    rank.synchronize()
    assert np.array_equal(rank.read("out").astype(np.float32), out)
    print(f"rank {me}: layer of {m}x{k} @ {k}x{out.shape[1]} over {n} ranks, eager and captured, agree")
