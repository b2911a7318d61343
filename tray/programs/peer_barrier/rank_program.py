"""The rank side of `tray gate peer-barrier`: time the barrier three ways, or test a dropped rank.

Figures (docs/design.md section 6), µs per barrier, median over repeats:
  eager       K barriers launched back to back, timed by the backend's timer (device events), / K
  eager_sync  one barrier launched and synchronised, per barrier
  captured    a graph of K barriers, replayed, / K
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import tray
from tray.errors import BarrierTimeout

WARMUP = 20
REPEATS = 7


def _eager(barrier, backend, iters: int, timeout_s: float) -> tuple[float, float]:
    """(device µs per barrier, host µs per launch): when the two are equal the loop is host-bound."""
    timer = backend.timer()
    timer.start()
    t0 = time.perf_counter()
    for _ in range(iters):
        barrier.launch(timeout_s)
    host_s = time.perf_counter() - t0
    timer.stop()
    elapsed = timer.elapsed_s()
    barrier.synchronize()
    barrier.check()
    return elapsed / iters * 1e6, host_s / iters * 1e6


def _eager_sync(barrier, iters: int, timeout_s: float) -> float:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        barrier.wait(timeout_s)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _captured(barrier, backend, graph, iters: int) -> float:
    timer = backend.timer()
    timer.start()
    graph.replay()
    timer.stop()
    elapsed = timer.elapsed_s()
    barrier.synchronize()
    barrier.check()
    return elapsed / iters * 1e6


def measure(rank, iters: int, timeout_s: float) -> dict:
    barrier, backend = rank.barrier_of("world"), rank.backend
    for _ in range(WARMUP):
        barrier.wait(timeout_s)
    eager_pairs = [_eager(barrier, backend, iters, timeout_s) for _ in range(REPEATS)]
    eager = [p[0] for p in eager_pairs]
    eager_sync = [_eager_sync(barrier, max(iters // 4, 10), timeout_s) for _ in range(REPEATS)]
    graph = backend.capture(lambda: [barrier.launch(timeout_s) for _ in range(iters)])
    try:
        graph.replay()  # warm: uploads the graph
        barrier.synchronize()
        barrier.check()
        captured = [_captured(barrier, backend, graph, iters) for _ in range(REPEATS)]
    finally:
        graph.close()
    return {"eager_us": statistics.median(eager), "eager_sync_us": statistics.median(eager_sync),
            "captured_us": statistics.median(captured),
            "eager_host_us": statistics.median(p[1] for p in eager_pairs),
            "eager_us_all": eager, "eager_sync_us_all": eager_sync,
            "captured_us_all": captured}


def drop_test(rank, drop: int, timeout_s: float) -> dict:
    if rank.rank == drop:
        return {"dropped": True}
    barrier = rank.barrier_of("world")
    t0 = time.perf_counter()
    try:
        barrier.wait(timeout_s)
    except BarrierTimeout as exc:
        return {"dropped": False, "missing": exc.missing, "seconds": time.perf_counter() - t0,
                "message": str(exc)}
    return {"dropped": False, "missing": [], "seconds": time.perf_counter() - t0,
            "message": f"the barrier passed although rank {drop} never entered it"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tray.programs.peer_barrier.rank_program")
    ap.add_argument("--iters", type=int, required=True)
    ap.add_argument("--timeout-s", type=float, required=True)
    ap.add_argument("--drop", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    with tray.init() as rank:
        info = rank.backend.info
        result = {"rank": rank.rank, "device": info.name, "uuid": info.uuid}
        if args.drop is None:
            result.update(measure(rank, args.iters, args.timeout_s))
        else:
            result.update(drop_test(rank, args.drop, args.timeout_s))
        # every rank, the dropped one too, waits here: nobody exits while a peer may still need it
        rank.exchange("gate-done", rank.rank, timeout_s=args.timeout_s + 30.0)
        result["timings"] = rank.timings
        path = Path(args.out) / f"rank-{rank.rank}.json"
        path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
