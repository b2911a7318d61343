"""PyTorch baselines measured in the same run as tray's figures (only where torch and GPUs exist).

    python bench/torch_baselines.py startup -n 4 --repeats 3
    python bench/torch_baselines.py torchrun -n 4 --repeats 3
    python bench/torch_baselines.py barrier -n 4 --iters 1000

`startup`: torch mp spawn -> init_process_group(nccl) -> first allreduce (seconds, median).
`torchrun`: `python -m torch.distributed.run --standalone --nproc-per-node N worker.py` executed -> the same first
allreduce in every worker (the launcher's own start and its `import torch` counted, as `tray launch`'s are).
`barrier`: SymmetricMemory barrier (eager, back to back / K, events; a CUDA graph of K; one barrier then
a stream synchronize, median of 200: the baseline of tray's eager_sync), and `dist.barrier()` (median of
200, a host-side barrier: reported, not compared). NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _startup_worker(rank: int, n: int, port: int, out: str) -> None:
    t_import = time.time()
    import torch
    import torch.distributed as dist

    imported = time.time()

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            device_id=torch.device("cuda", rank))
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    assert x.item() == n
    Path(out, f"rank-{rank}").write_text(json.dumps({"t_first": time.time(), "import_s": imported - t_import,
                                                     "t_imported": imported}))
    dist.destroy_process_group()


TORCHRUN_WORKER = """
import json, os, sys, time
t_start = time.time()
import torch
import torch.distributed as dist
t_imported = time.time()
rank, n, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
x = torch.ones(1, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
assert x.item() == n
with open(os.path.join(sys.argv[1], f"rank-{rank}"), "w") as f:
    json.dump({"t_start": t_start, "t_imported": t_imported, "t_first": time.time()}, f)
dist.destroy_process_group()
"""


def torchrun(n: int, repeats: int) -> dict:
    """`torchrun` executed -> first allreduce in every worker (s, median); `launcher_s`: until the first worker's
    first line ran; `import_s`: until every worker imported torch; `exit_s`: until the command returned."""
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            worker = Path(out, "worker.py")
            worker.write_text(TORCHRUN_WORKER)
            t0 = time.time()
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                            str(worker), out], check=True, capture_output=True, timeout=300)
            t_exit = time.time()
            ranks = [json.loads(Path(out, f"rank-{r}").read_text()) for r in range(n)]
        runs.append({"first_allreduce_s": max(r["t_first"] for r in ranks) - t0,
                     "launcher_s": min(r["t_start"] for r in ranks) - t0,
                     "import_s": max(r["t_imported"] for r in ranks) - t0, "exit_s": t_exit - t0})
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["runs"] = runs
    return out


def _barrier_worker(rank: int, n: int, port: int, out: str, iters: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            device_id=torch.device("cuda", rank))
    buf = symm_mem.empty(1024, device="cuda")
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    for _ in range(50):
        hdl.barrier(channel=0)
    torch.cuda.synchronize()

    def events_us(fn) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3 / iters

    def eager() -> None:
        for _ in range(iters):
            hdl.barrier(channel=0)

    eager_us = statistics.median(events_us(eager) for _ in range(7))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        eager()  # warm on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            eager()
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    captured_us = statistics.median(events_us(graph.replay) for _ in range(7))
    samples = []
    stream = torch.cuda.current_stream()
    for _ in range(200):  # what tray's eager_sync is: one barrier launched, then the stream synchronised
        t0 = time.perf_counter()
        hdl.barrier(channel=0)
        stream.synchronize()
        samples.append(time.perf_counter() - t0)
    symm_sync_us = statistics.median(samples) * 1e6
    samples = []
    for _ in range(200):
        t0 = time.perf_counter()
        dist.barrier()
        samples.append(time.perf_counter() - t0)
    dist_barrier_us = statistics.median(samples) * 1e6
    Path(out, f"rank-{rank}").write_text(json.dumps(
        {"symm_eager_us": eager_us, "symm_captured_us": captured_us, "symm_sync_us": symm_sync_us,
         "dist_barrier_us": dist_barrier_us}))
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def _spawn(target, n: int, extra: tuple) -> tuple[float, list[str]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        t0 = time.time()
        mp.spawn(target, args=(n, _free_port(), out) + extra, nprocs=n, join=True)
        return t0, [Path(out, f"rank-{r}").read_text() for r in range(n)]


def startup(n: int, repeats: int) -> dict:
    """spawn -> first allreduce (s, median), spawn -> torch imported in every child (`import_s`: the
    spawn bootstrap imports torch before the worker runs, so the worker's own `import torch` is free) and
    the time from the last rank's import to the first allreduce (comparable with tray's after-import)."""
    samples, imports, after = [], [], []
    for _ in range(repeats):
        t0, outs = _spawn(_startup_worker, n, ())
        ranks = [json.loads(o) for o in outs]
        first = max(r["t_first"] for r in ranks)
        samples.append(first - t0)
        imports.append(max(r["t_imported"] for r in ranks) - t0)
        after.append(first - max(r["t_imported"] for r in ranks))
    return {"first_allreduce_s": statistics.median(samples), "import_s": statistics.median(imports),
            "after_import_s": statistics.median(after), "samples_s": samples}


def barrier(n: int, iters: int) -> dict:
    _, outs = _spawn(_barrier_worker, n, (iters,))
    per_rank = [json.loads(o) for o in outs]
    out = {"per_rank": per_rank}
    for key in ("symm_eager_us", "symm_captured_us", "symm_sync_us", "dist_barrier_us"):
        out[key] = statistics.median(r[key] for r in per_rank)
    return out


def run_baseline(kind: str, n: int, timeout_s: float = 300.0, **kw) -> dict | None:
    """Run a baseline in a fresh interpreter; None when torch or GPUs are missing or it fails."""
    args = [sys.executable, __file__, kind, "-n", str(n)] + [f"--{k}={v}" for k, v in kw.items()]
    env = dict(os.environ, **SAFE_ENV)
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        print(f"baseline {kind}: timed out after {timeout_s:.0f} s", file=sys.stderr)
        return None
    if proc.returncode != 0:
        print(f"baseline {kind} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def torch_startup(n: int, repeats: int) -> dict | None:
    return run_baseline("startup", n, repeats=repeats)


def torchrun_startup(n: int, repeats: int) -> dict | None:
    return run_baseline("torchrun", n, repeats=repeats)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=("startup", "torchrun", "barrier"))
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=1000)
    args = ap.parse_args()
    os.environ.update(SAFE_ENV)
    if args.kind == "startup":
        result = startup(args.n, args.repeats)
    elif args.kind == "torchrun":
        result = torchrun(args.n, args.repeats)
    else:
        result = barrier(args.n, args.iters)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
