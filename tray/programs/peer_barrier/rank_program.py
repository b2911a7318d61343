"""The rank side of `tray gate peer-barrier`: time the barrier three ways, test a dropped rank, or
stress the barrier's ordering contract.

Figures (docs/design.md section 6), µs per barrier, median over repeats:
  eager       K barriers launched back to back, timed by the backend's timer (device events), / K
              (on the cuda backend each a launch of a one-barrier graph, unless TRAY_BARRIER_LAUNCH=kernel)
  eager_kernel  the same, every barrier a kernel launch (cuLaunchKernelEx; cuda backend only)
  eager_sync  one barrier launched and synchronised, per barrier
  captured    a graph of K barriers, replayed, / K
  eager_graph K launches of a graph of one barrier from Python, / K (the other launch path an eager
              caller has: cuGraphLaunch instead of cuLaunchKernelEx; both figures carry their host cost)

Stress (`--stress`, manifest peer_stress): rounds of produce -> barrier -> check (manifests/kernels/
peer_stress.cu), first eagerly, then as a captured graph replayed several times, with no host
synchronisation between the rounds; the device counts the words that did not match.
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


def _eager(barrier, backend, iters: int, timeout_s: float, launch=None) -> tuple[float, float]:
    """(device µs per barrier, host µs per launch) of `launch` (default: barrier.launch): when the two are
    equal the loop is host-bound."""
    launch = launch or barrier.launch
    timer = backend.timer()
    timer.start()
    t0 = time.perf_counter()
    for _ in range(iters):
        launch(timeout_s)
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


def _eager_graph(barrier, backend, graph, iters: int) -> tuple[float, float]:
    """(device µs per barrier, host µs per launch) of `iters` replays of a one-barrier graph."""
    timer = backend.timer()
    timer.start()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    host_s = time.perf_counter() - t0
    timer.stop()
    elapsed = timer.elapsed_s()
    barrier.synchronize()
    barrier.check()
    return elapsed / iters * 1e6, host_s / iters * 1e6


def measure(rank, iters: int, timeout_s: float) -> dict:
    barrier, backend = rank.barrier_of("world"), rank.backend
    for _ in range(WARMUP):
        barrier.wait(timeout_s)
    eager_pairs = [_eager(barrier, backend, iters, timeout_s) for _ in range(REPEATS)]
    eager = [p[0] for p in eager_pairs]
    launch_kernel = getattr(barrier, "launch_kernel", None)  # the cuda barrier's other eager path
    kernel_pairs = [_eager(barrier, backend, iters, timeout_s, launch_kernel) for _ in range(REPEATS)] \
        if launch_kernel is not None else []
    eager_sync = [_eager_sync(barrier, max(iters // 4, 10), timeout_s) for _ in range(REPEATS)]
    graph = backend.capture(lambda: [barrier.launch(timeout_s) for _ in range(iters)])
    try:
        graph.replay()  # warm: uploads the graph
        barrier.synchronize()
        barrier.check()
        captured = [_captured(barrier, backend, graph, iters) for _ in range(REPEATS)]
    finally:
        graph.close()
    single = backend.capture(lambda: barrier.launch(timeout_s))
    try:
        single.replay()
        barrier.synchronize()
        graph_pairs = [_eager_graph(barrier, backend, single, iters) for _ in range(REPEATS)]
    finally:
        single.close()
    kernel = {"eager_kernel_us": statistics.median(p[0] for p in kernel_pairs),
              "eager_kernel_host_us": statistics.median(p[1] for p in kernel_pairs)} if kernel_pairs else {}
    return {**kernel, "eager_us": statistics.median(eager), "eager_sync_us": statistics.median(eager_sync),
            "captured_us": statistics.median(captured),
            "eager_graph_us": statistics.median(p[0] for p in graph_pairs),
            "eager_graph_host_us": statistics.median(p[1] for p in graph_pairs),
            "eager_host_us": statistics.median(p[1] for p in eager_pairs),
            "eager_us_all": eager, "eager_sync_us_all": eager_sync,
            "captured_us_all": captured}


# NOTE: 256 threads x 264 blocks (2 per SM of an H200) keep every SM writing; the kernels grid-stride.
STRESS_BLOCK = 256
STRESS_MAX_GRID = 264
CORRUPT_ROUND = 3  # a round inside the eager pass: the fault is injected once, early


def stress(rank, rounds: int, replays: int, skew_ns: int, corrupt: int | None, timeout_s: float) -> dict:
    """Run `rounds` stress rounds eagerly, then a graph of `rounds` rounds `replays` times; returns the
    device's verdict: {"rounds", "rounds_expected", "mismatches", "bad_writers", "first_bad_round",
    "captured_round_us"}. Every rank must call it with the same arguments."""
    import numpy as np

    import tray.programs.peer_barrier.twins  # noqa: F401  (host twins of the stress kernels)

    G, me = rank.world_size, rank.rank
    stress_buf, state = rank.buffer("stress"), rank.buffer("stress_state")
    words = stress_buf.nbytes // 4 // (2 * G)
    grid = (max(1, min(STRESS_MAX_GRID, -(-G * words // STRESS_BLOCK))), 1, 1)
    block = (STRESS_BLOCK, 1, 1)
    corrupt_round = CORRUPT_ROUND if corrupt == me else 0
    produce_args = [rank.peers("stress").table_ptr, state.ptr, G, me, words, skew_ns, corrupt_round]
    launches = [
        rank.kernel("stress_next").bind((1, 1, 1), (1, 1, 1), [state.ptr]),
        rank.kernel("stress_produce").bind(grid, block, produce_args),
    ]
    check = rank.kernel("stress_check").bind(grid, block, [stress_buf.ptr, state.ptr, G, me, words])
    barrier, backend = rank.barrier_of("world"), rank.backend

    def one_round() -> None:
        for launch in launches:
            launch.launch()
        barrier.launch(timeout_s)
        check.launch()

    rank.write("stress_state", np.zeros(4, np.uint64))
    rank.synchronize()
    rank.exchange("stress.zeroed", me)  # no rank writes into a peer before every state is zeroed
    for _ in range(rounds):
        one_round()
    graph = backend.capture(lambda: [one_round() for _ in range(rounds)])
    timer = backend.timer()
    try:
        timer.start()
        for _ in range(replays):
            graph.replay()
        timer.stop()
        rank.synchronize()
        elapsed = timer.elapsed_s()
    finally:
        graph.close()
    st = rank.read("stress_state")
    return {"rounds": int(st[0]), "rounds_expected": rounds * (1 + replays), "words_per_slot": words,
            "skew_ns": skew_ns, "mismatches": int(st[1]),
            "bad_writers": [w for w in range(G) if int(st[2]) >> w & 1], "first_bad_round": int(st[3]),
            "corrupt_round": corrupt_round, "captured_round_us": elapsed / max(1, replays * rounds) * 1e6}


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
    ap.add_argument("--stress", action="store_true", help="producer -> barrier -> consumer rounds")
    ap.add_argument("--replays", type=int, default=5, help="--stress: graph replays of --iters rounds")
    ap.add_argument("--skew-ns", type=int, default=2000, help="--stress: late-rank delay step")
    ap.add_argument("--corrupt", type=int, default=None, help="--stress: this rank sends one wrong word")
    args = ap.parse_args(argv)
    with tray.init() as rank:
        info = rank.backend.info
        result = {"rank": rank.rank, "device": info.name, "uuid": info.uuid}
        if args.stress:
            result["stress"] = stress(rank, args.iters, args.replays, args.skew_ns, args.corrupt, args.timeout_s)
        elif args.drop is None:
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
