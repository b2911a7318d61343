"""The hierarchical barrier over a group that spans nodes, on GPUs: two `tray launch --nnodes 2` over half the
visible GPUs each (each with its own NCCL_HOSTID, so NCCL sees two hosts): eager, captured, and one rank
out, named by every other rank within the bound."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import MANIFESTS, gpu_ranks, visible_gpus

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "host"))
from test_multinode import STAGED_BODY, TOKEN, finish, free_port, staged_fill_manifest

pytestmark = pytest.mark.gpu
FILL = str(MANIFESTS / "peer_fill.json")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def start_cuda_job(tray_env, body: str, timeout_s: float, manifest: str = FILL) -> tuple[int, list[subprocess.Popen]]:
    """Two nodes of L = (visible GPUs, at most 4) // 2 ranks each (with TRAY_SHARE_GPUS=1: 2 each, every node over
    every visible GPU); (L, the heads)."""
    gpus, real = gpu_ranks(), visible_gpus()
    if gpus < 2:
        pytest.skip(f"two nodes of one GPU each need 2 GPUs; {gpus} visible")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ordinals = [d for d in visible.split(",") if d] or [str(i) for i in range(real)]
    per_node = gpus // 2
    shared = gpus > real  # ranks share GPUs: each node sees them all
    port, prog = free_port(), tray_env.script(body)
    procs = []
    for node in (0, 1):
        mine = ordinals if shared else ordinals[node * per_node:(node + 1) * per_node]
        env = {**tray_env.env(), **NO_MULTICAST, "TRAY_JOB_TOKEN": TOKEN, "NCCL_HOSTID": f"tray-span-node-{node}",
               "CUDA_VISIBLE_DEVICES": ",".join(mine)}
        cmd = [sys.executable, "-m", "tray", "launch", "-n", str(per_node), "--backend", "cuda", "--manifest", manifest,
               "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--timeout-s", str(timeout_s), "--", sys.executable, str(prog), tray_env.marker]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      cwd=str(tray_env.tmp)))
    return per_node, procs


def test_spanning_barrier_is_hierarchical_eager_and_captured_and_names_a_dropped_rank(tray_env):
    body = """
    with tray.init() as rank:
        me, n = rank.rank, rank.world_size
        world = rank.barrier_of("world")
        assert world.path == "hierarchical", world.path
        for _ in range(50):
            rank.barrier()
        for _ in range(200):                      # eager: launched back to back, one synchronisation
            world.launch(2.0)
        rank.synchronize()
        graph = rank.backend.capture(lambda: [world.launch(2.0) for _ in range(20)])
        for _ in range(5):
            graph.replay()
        rank.synchronize()
        graph.close()
        stream = rank.backend.cuda_stream          # on a caller's stream: ordered, not synchronised
        rank.barrier(stream=stream)
        rank.synchronize()
        print("span ok", me, flush=True)
        if me != n - 1:
            t = time.monotonic()
            try:
                rank.barrier(timeout_s=0.5)
            except tray.BarrierTimeout as exc:
                print("missing", exc.missing, round(time.monotonic() - t, 2), flush=True)
        else:
            time.sleep(6)
    """
    per_node, procs = start_cuda_job(tray_env, body, 120)
    runs = finish(procs, timeout_s=240)
    n = 2 * per_node
    for node, run in enumerate(runs):
        assert run.returncode == 0, run.output
        for r in range(node * per_node, (node + 1) * per_node):
            assert f"[rank {r}] span ok {r}" in run.stdout, run.output
    for r in range(n - 1):
        found = re.search(rf"\[rank {r}\] missing \[{n - 1}\] ([0-9.]+)", runs[r // per_node].stdout)
        assert found, runs[r // per_node].output
        # a member of another node is named after the local timeout and the leaders' step; a leader (one GPU
        # per node) by the bounded wait: 3 x 0.5 s + 1 s past the local barrier, + 1 s
        assert float(found.group(1)) < 4.5, runs[r // per_node].output


def test_a_staged_peers_kernel_spans_nodes_on_gpus(tray_env, tmp_path):
    """peer_fill over world: within a node through the peer mappings (with 4 GPUs, 2 per node), to the other
    node through the staged table and an NCCL alltoall across nodes; every rank checks every slot."""
    manifest = staged_fill_manifest(tmp_path / "staged.json", MANIFESTS / "kernels" / "peer_fill.cu")
    per_node, procs = start_cuda_job(tray_env, STAGED_BODY, 60.0, manifest)
    runs = finish(procs, timeout_s=120)
    for node, run in enumerate(runs):
        assert run.returncode == 0, run.output
        for r in range(node * per_node, (node + 1) * per_node):
            assert f"[rank {r}] staged ok {r}" in run.stdout, run.output
