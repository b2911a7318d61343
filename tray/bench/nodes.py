"""A bench's rank program as a job of several nodes on this machine: one `tray launch --nnodes N` per node,
each over its share of the ranks (on cuda its share of the visible GPUs, and its own NCCL_HOSTID so NCCL
sees N hosts and crosses between them over its network transport), joined through node 0's root on
127.0.0.1. Node identity is the node rank given, so the nodes never map each other's buffers.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tray.bench import TrayFailed
from tray.envvars import own_python
from tray.errors import UsageError

# NOTE: a bench run (checks, timings, replays) lasts minutes on GPUs; this bounds a job that never ends.
DEFAULT_JOB_TIMEOUT_S = 1800.0
# NOTE: after SIGTERM a head stops its ranks within its own grace; past this it is killed.
STOP_GRACE_S = 15.0
ROOT_HOST = "127.0.0.1"


@dataclass(frozen=True)
class NodeJob:
    """What `run_rank_program_nodes` launches: `nnodes` nodes of `nprocs // nnodes` ranks each."""

    name: str
    module: str
    nnodes: int
    nprocs: int
    backend: str
    manifest: str
    vars: dict[str, int]
    log_dir: str | None = None
    env: dict[str, str] | None = None
    timeout_s: float = DEFAULT_JOB_TIMEOUT_S

    @property
    def per_node(self) -> int:
        return self.nprocs // self.nnodes


def check_nnodes(nnodes: int, nprocs: int) -> None:
    """UsageError unless `nnodes` nodes can split `nprocs` ranks evenly (the benches' --nnodes and -n)."""
    if nnodes < 1 or nprocs % nnodes:
        raise UsageError(f"--nnodes {nnodes} must be at least 1 and divide -n {nprocs} (every node runs the "
                         "same number of ranks)")


def node_devices(nnodes: int, nprocs: int, visible: str | None, count: int, share: bool = False) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each node: node i gets the i-th share of the visible GPUs (`visible`, the
    parent's CUDA_VISIBLE_DEVICES, or ordinals 0..count-1 when unset); with `share` (ranks may share GPUs) and
    too few GPUs for a share each, every node gets them all. Raises UsageError when the shares do not fit."""
    if visible is not None:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    else:
        gpus = [str(i) for i in range(count)]
    if nprocs % nnodes:
        raise UsageError(f"--nnodes {nnodes} must divide -n {nprocs} (every node runs the same number of ranks)")
    if nprocs > len(gpus) and share and gpus:
        return [",".join(gpus)] * nnodes
    if nprocs > len(gpus):
        raise UsageError(f"{nnodes} nodes of {nprocs // nnodes} ranks need {nprocs} GPUs, {len(gpus)} visible")
    per = nprocs // nnodes
    return [",".join(gpus[i * per:(i + 1) * per]) for i in range(nnodes)]


def free_port(host: str = ROOT_HOST) -> int:
    """A TCP port free on `host` now (the root binds it a moment later; the root port + 1 is MASTER_PORT)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _node_cmd(job: NodeJob, node: int, port: int, cfg_path: Path) -> list[str]:
    python, _ = own_python()
    cmd = [*python, "-m", "tray", "launch", "--nnodes", str(job.nnodes), "--node-rank", str(node),
           "--rdzv-endpoint", f"{ROOT_HOST}:{port}", "--rdzv-id", job.name, "-n", str(job.per_node),
           "--backend", job.backend, "--manifest", job.manifest, "-q", "--local-ranks-filter", "0"]
    for k, v in sorted(job.vars.items()):
        cmd += ["--var", f"{k}={v}"]
    if job.log_dir:
        cmd += ["--log-dir", str(Path(job.log_dir) / f"node{node}")]
    return [*cmd, "--", *python, "-m", job.module, str(cfg_path)]


def _node_env(job: NodeJob, node: int, token: str, devices: list[str] | None) -> dict[str, str]:
    env = {**os.environ, **(job.env or {}), "TRAY_JOB_TOKEN": token, "PYTHONPATH": own_python()[1]}
    # NOTE: its own host id per node: NCCL then treats the nodes as separate hosts (network transport
    # between them, no shared-memory or NVLink shortcut), as two machines would be
    env["NCCL_HOSTID"] = f"tray-{job.name}-node{node}"
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices[node]
    return env


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the heads still running (each stops its ranks), SIGKILL those past STOP_GRACE_S."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _root_cause(logs: list[Path]) -> str:
    """The heads' `tray: FAILED` lines (every head prints the job's root cause), else the last log lines."""
    lines: list[str] = []
    for log in logs:
        text = log.read_text(errors="replace") if log.exists() else ""
        failed = [ln for ln in text.splitlines() if ln.startswith("tray: FAILED")]
        lines += failed or text.splitlines()[-5:]
    return "\n".join(dict.fromkeys(lines)) or "no head printed a root cause"


def run_rank_program_nodes(job: NodeJob, cfg: dict[str, Any], work: Path) -> list[dict[str, Any]]:
    """Launch `python -m job.module CFG.json` as a job of `job.nnodes` nodes on this machine; each rank
    writes `result_*.json` into `cfg["out_dir"]` (set here to work/job.name). Node 0's output (rank 0's
    progress lines) shows on this terminal; every node's head writes work/<name>-node<i>.log. Returns the
    results in file-name order. Raises UsageError when the GPUs do not fit, TrayFailed with the heads'
    root cause when a node fails or the job outlives `job.timeout_s` (then every head is stopped)."""
    devices = None
    if job.backend == "cuda":
        from tray.backend.cuda import visible_gpu_count
        from tray.envvars import share_gpus

        devices = node_devices(job.nnodes, job.nprocs, os.environ.get("CUDA_VISIBLE_DEVICES"), visible_gpu_count(),
                               share_gpus(None, os.environ.get("TRAY_SHARE_GPUS")))
    elif job.nprocs % job.nnodes:
        raise UsageError(f"--nnodes {job.nnodes} must divide -n {job.nprocs} (every node runs the same number "
                         "of ranks)")
    out = work / job.name
    out.mkdir()
    cfg_path = work / f"{job.name}.json"
    cfg_path.write_text(json.dumps({**cfg, "out_dir": str(out)}))
    token, port = secrets.token_hex(32), free_port()
    logs = [work / f"{job.name}-node{i}.log" for i in range(job.nnodes)]
    procs: list[subprocess.Popen] = []
    files = []
    try:
        for node in range(job.nnodes):
            log = open(logs[node], "w")  # closed below, after the head exits
            files.append(log)
            cmd, env = _node_cmd(job, node, port, cfg_path), _node_env(job, node, token, devices)
            procs.append(subprocess.Popen(cmd, env=env, stdout=None if node == 0 else log, stderr=log))
        deadline = time.monotonic() + job.timeout_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running = [n for n, q in enumerate(procs) if q.poll() is None]
                _stop(procs)
                raise TrayFailed(f"the {job.name} job did not end within {job.timeout_s:.0f} s: nodes {running} "
                                 f"still running (stopped); {_root_cause(logs)}") from None
    except BaseException:
        _stop(procs)
        raise
    finally:
        for f in files:
            f.close()
    codes = [p.returncode for p in procs]
    if any(codes):
        raise TrayFailed(f"the {job.name} job failed (node exit codes {codes}): {_root_cause(logs)}")
    return [json.loads(f.read_text()) for f in sorted(out.glob("result_*.json"))]
