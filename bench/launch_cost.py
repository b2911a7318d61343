"""Host cost of one launch from Python, per launch path, on one GPU (the cuda backend, device 0).

    python bench/launch_cost.py --launches 1000 --repeats 7 --json launch_cost.json

Each path is launched `--launches` times back to back, `--repeats` times; per path the median host µs per
launch (time.perf_counter around the loop) and device µs per launch (events around the same loop). When the
two are equal the loop is host-bound. Paths:
  kernel           a one-thread kernel (an atomic increment) through drv.launcher: cuLaunchKernel
  kernel_pdl       the same with programmatic stream serialization: cuLaunchKernelEx (the barrier's default)
  graph            a one-node graph of that kernel, CudaGraph.replay(): cuGraphLaunch
  barrier_kernel   the peer barrier of a one-member group, every launch a kernel launch (the old eager path)
  barrier          barrier.launch(): the eager path (a one-barrier graph unless TRAY_BARRIER_LAUNCH=kernel)
  event_record     timer.start(): cuEventRecord through its prepared call
  torch_add        (torch importable) `x.add_(1)` on a one-element tensor: a small torch kernel launch
  torch_graph      (torch importable) a torch CUDA graph of that add, replayed
Correctness first: the increment counter, the barrier's epoch and the torch tensor must count every launch.
Ratios are to `barrier_kernel`, the eager barrier launch before the graph path.

In a graph (`--launches` nodes captured into one graph, replayed `--repeats` times; device µs per node, the
floor a captured barrier sits on; host µs is the replay's host cost over its nodes):
  graph_nodes_kernel      the tick kernel, one node after the other
  graph_nodes_kernel_pdl  the same launched programmatically, as the barrier is (a programmatic edge per node)
  graph_nodes_barrier     the one-member peer barrier, as the gate's captured mode records it: what a captured
                          barrier costs without a peer to wait for
  graph_nodes_flag_table  the barrier's own path pared down (one thread, programmatic: wait, epoch, fence, flag
                          store, acquire poll), the flag's address read from a pointer table in device memory
                          as the barrier reads its members'
  graph_nodes_flag_param  the same with the address a kernel parameter: what that dependent load costs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from tray.backend.base import GroupInfo
from tray.bench import write_report

NOOP_SOURCE = r"""
extern "C" __global__ void tray_launch_cost_tick(unsigned long long* count) {
    atomicAdd(count, 1ull);  // atomic: programmatic launches may overlap the previous one
}
"""
FLAG_SOURCE = r"""
__device__ __forceinline__ void flag_round(unsigned long long* flag, unsigned long long* counter) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const unsigned long long e = *counter + 1ull;
    *counter = e;
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(e) : "memory");
    unsigned long long seen = 0ull;
    do {
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(seen) : "l"(flag) : "memory");
    } while (seen < e);
}

extern "C" __global__ void tray_launch_cost_flag_table(unsigned long long* const* table,
                                                       unsigned long long* counter) {
    flag_round(table[0], counter);
}

extern "C" __global__ void tray_launch_cost_flag_param(unsigned long long* flag, unsigned long long* counter) {
    flag_round(flag, counter);
}
"""
WARMUP = 50
WARMUP_REPLAYS = 2
TIMEOUT_S = 2.0


def _series(launch: Callable[[], None], n: int, repeats: int, timed: Callable[[Callable[[], None], int], Any]
            ) -> dict[str, Any]:
    for _ in range(WARMUP):
        launch()
    return _series_timed(partial(timed, launch, n), repeats)


def _tray_timed(backend: Any) -> Callable[[Callable[[], None], int], tuple[float, float]]:
    def timed(launch: Callable[[], None], n: int) -> tuple[float, float]:
        backend.synchronize()
        timer = backend.timer()
        timer.start()
        t0 = time.perf_counter()
        for _ in range(n):
            launch()
        host_s = time.perf_counter() - t0
        timer.stop()
        device_s = timer.elapsed_s()
        timer.close()
        return host_s / n * 1e6, device_s / n * 1e6

    return timed


def _graph_series(backend: Any, body: Callable[[], None], nodes: int, repeats: int) -> dict[str, Any]:
    """A graph of `nodes` launches made by `body`, replayed WARMUP_REPLAYS + `repeats` times: device and host µs
    per node (median over the timed replays)."""
    graph = backend.capture(body)
    try:
        for _ in range(WARMUP_REPLAYS):
            graph.replay()
        row = _series_timed(partial(_tray_timed(backend), graph.replay, 1), repeats)
    finally:
        graph.close()
    return {k: (v / nodes if isinstance(v, float) else [x / nodes for x in v]) for k, v in row.items()} | {
        "nodes": nodes}


def _series_timed(timed: Callable[[], tuple[float, float]], repeats: int) -> dict[str, Any]:
    pairs = [timed() for _ in range(repeats)]
    host = [p[0] for p in pairs]
    device = [p[1] for p in pairs]
    return {"host_us": statistics.median(host), "device_us": statistics.median(device),
            "host_us_all": host, "device_us_all": device}


def tray_paths(n: int, repeats: int) -> dict[str, dict[str, Any]]:
    """The tray launch paths on device 0; raises RuntimeError when a path miscounts its launches."""
    from tray.backend.cuda import CudaBackend

    paths: dict[str, dict[str, Any]] = {}
    with CudaBackend.open(0) as backend:
        timed = _tray_timed(backend)
        count = backend.allocate("launch_cost_count", 8, export=False)
        backend.write(count.ptr, np.zeros(1, np.uint64))
        tick = backend.load_kernel("launch_cost_tick", NOOP_SOURCE.encode(), "tray_launch_cost_tick", [],
                                   peers=False)
        plain = tick.bind((1, 1, 1), (1, 1, 1), [count])
        pdl = tick.bind((1, 1, 1), (1, 1, 1), [count], programmatic=backend.capability >= (9, 0))
        graph = backend.capture(plain.launch)
        flags = backend.allocate("launch_cost_flags", 8, export=True)
        barrier = backend.barrier(GroupInfo("solo", (0,), 0), flags, backend.ptr_table([flags.ptr]))
        event_timer = backend.timer()
        ticks = 0
        for name, launch, is_tick in (("kernel", plain.launch, True), ("kernel_pdl", pdl.launch, True),
                                      ("graph", graph.replay, True),
                                      ("barrier_kernel", partial(barrier.launch_kernel, TIMEOUT_S), False),
                                      ("barrier", partial(barrier.launch, TIMEOUT_S), False),
                                      ("event_record", event_timer.start, False)):
            paths[name] = _series(launch, n, repeats, timed)
            ticks += (WARMUP + n * repeats) if is_tick else 0
        replayed = n * (WARMUP_REPLAYS + repeats)
        for name, bound in (("graph_nodes_kernel", plain), ("graph_nodes_kernel_pdl", pdl)):
            paths[name] = _graph_series(backend, partial(_times, bound.launch, n), n, repeats)
            ticks += replayed
        paths["graph_nodes_barrier"] = _graph_series(backend, partial(_times, partial(barrier.launch, TIMEOUT_S), n),
                                                     n, repeats)
        pd = backend.capability >= (9, 0)
        rounds = backend.allocate("launch_cost_rounds", 16, export=False)
        backend.write(rounds.ptr, np.zeros(2, np.uint64))
        flag = backend.allocate("launch_cost_flag", 8, export=True)
        table = backend.ptr_table([flag.ptr])
        for name, entry, first in (("graph_nodes_flag_table", "tray_launch_cost_flag_table", table),
                                   ("graph_nodes_flag_param", "tray_launch_cost_flag_param", flag)):
            kernel = backend.load_kernel(entry, FLAG_SOURCE.encode(), entry, [], peers=False)
            bound = kernel.bind((1, 1, 1), (1, 1, 1), [first, rounds], programmatic=pd)
            paths[name] = _graph_series(backend, partial(_times, bound.launch, n), n, repeats)
        backend.synchronize()
        done = int(backend.read(rounds.ptr, 8).view(np.uint64)[0])
        if done != 2 * replayed or int(backend.read(flag.ptr, 8).view(np.uint64)[0]) != done:
            raise RuntimeError(f"the flag kernels made {done} rounds, {2 * replayed} were launched")
        backend.synchronize()
        barrier.check()
        got = int(backend.read(count.ptr, 8).view(np.uint64)[0])
        if got != ticks:
            raise RuntimeError(f"the tick kernel counted {got} launches, {ticks} were made")
        epoch, expected = barrier.epoch(), 2 * (WARMUP + n * repeats) + replayed
        if epoch != expected:
            raise RuntimeError(f"the barrier's epoch is {epoch} after {expected} launches")
        paths["barrier"]["mode"] = barrier.mode
    return paths


def _times(launch: Callable[[], None], n: int) -> None:
    for _ in range(n):
        launch()


def torch_paths(n: int, repeats: int) -> dict[str, dict[str, Any]] | str:
    """torch's small-kernel launch and graph replay on device 0, or why they were not measured."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable: {exc}"
    if not torch.cuda.is_available():
        return "torch sees no GPU"
    torch.cuda.set_device(0)
    x = torch.zeros(1, dtype=torch.int64, device="cuda")

    def timed(launch: Callable[[], None], k: int) -> tuple[float, float]:
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(k):
            launch()
        host_s = time.perf_counter() - t0
        stop.record()
        stop.synchronize()
        return host_s / k * 1e6, start.elapsed_time(stop) / k * 1e3

    paths = {"torch_add": _series(lambda: x.add_(1), n, repeats, timed)}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)  # NOTE: torch's own warm-up on the side stream before capture, as torch.cuda.graphs advises
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    paths["torch_graph"] = _series(graph.replay, n, repeats, timed)
    torch.cuda.synchronize()
    expected = 2 * (WARMUP + n * repeats) + 1
    if int(x.item()) != expected:
        raise RuntimeError(f"torch's tensor counted {int(x.item())} adds, {expected} were made")
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/launch_cost.py", description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=1000, help="launches per timed loop (default 1000)")
    ap.add_argument("--repeats", type=int, default=7, help="timed loops per path (default 7)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch reference paths")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    if args.launches < 1 or args.repeats < 1:
        ap.error(f"--launches and --repeats must be >= 1, got {args.launches} and {args.repeats}")
    paths: dict[str, Any] = tray_paths(args.launches, args.repeats)
    torch_note = "skipped (--no-torch)" if args.no_torch else torch_paths(args.launches, args.repeats)
    if isinstance(torch_note, dict):
        paths.update(torch_note)
        torch_note = "measured"
    base = paths["barrier_kernel"]["host_us"]
    print(f"launch cost on device 0: {args.launches} launches x {args.repeats} repeats (µs per launch, median)")
    print(f"  {'path':<16}{'host':>8}{'device':>9}{'host/barrier_kernel':>21}")
    for name, p in paths.items():
        p["host_ratio_to_barrier_kernel"] = p["host_us"] / base
        print(f"  {name:<16}{p['host_us']:>8.2f}{p['device_us']:>9.2f}{p['host_ratio_to_barrier_kernel']:>21.2f}")
    print(f"  torch: {torch_note}; barrier mode: {paths['barrier']['mode']}")
    report = {"bench": "launch_cost", "launches": args.launches, "repeats": args.repeats, "paths": paths,
              "torch": torch_note, "barrier_launch_env": os.environ.get("TRAY_BARRIER_LAUNCH")}
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
