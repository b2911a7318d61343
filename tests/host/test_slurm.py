"""Two nodes under a real Slurm (marker `cluster`; launch/slurm/local-cluster.sh makes one on this machine):
the sbatch script and `srun ... tray launch --slurm`, 2 nodes x 2 ranks on the host backend."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from conftest import MANIFESTS, REPO

pytestmark = pytest.mark.cluster
FILL = str(MANIFESTS / "peer_fill.json")
TOKEN = "5eedcafe0123456789abcdef5eedcafe"

BODY = """
with tray.init() as rank:
    me, n = rank.rank, rank.world_size
    assert n == 4 and os.environ["GROUP_RANK"] == str(me // 2), (n, os.environ["GROUP_RANK"])
    assert rank.exchange("who", me) == [0, 1, 2, 3]
    rank.barrier()
    c = rank.collectives("world")
    rank.write("send", np.full(64, me + 1, np.float32))
    c.allreduce(rank.buffer("send").ptr, rank.buffer("recv").ptr, 64, "f32")
    assert (rank.read("recv")[:64] == 10).all()
    print("slurm job ok", me, os.environ["SLURM_NODEID"])
"""


def _wait_for_job(job_id: str, timeout_s: float) -> dict[str, str]:
    """The job's final `scontrol show job` fields; polled every 0.1 s (`sbatch --wait` polls every 2 s+)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                             timeout=10).stdout
        fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], timeout=10)
            raise AssertionError(f"Slurm job {job_id} still {fields.get('JobState')} after {timeout_s:.0f} s")
        time.sleep(0.1)


def test_sbatch_script_runs_two_nodes(tray_env, tmp_path):
    prog = tray_env.script(BODY)
    out = tmp_path / "job.out"
    env = tray_env.env()
    env["TRAY"] = f"{sys.executable} -m tray"
    cmd = ["sbatch", "--parsable", "-N", "2", f"--output={out}", str(REPO / "launch" / "slurm" / "tray.sbatch"),
           "-n", "2", "--backend", "host", "--manifest", FILL, "--var", "count=64", "--var", "words=16",
           "--", sys.executable, str(prog), tray_env.marker]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = _wait_for_job(proc.stdout.strip().split(";")[0], timeout_s=120)
    text = out.read_text() if out.exists() else ""
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, text)
    for r in range(4):
        assert f"[rank {r}] slurm job ok {r} {r // 2}" in text, text
    assert "TRAY_JOB_TOKEN" not in " ".join(cmd)
    # both nodes write into one file: each line says its node (srun --label)
    for node in (0, 1):
        assert re.search(rf"^{node}: \[rank {2 * node}\] slurm job ok", text, re.M), text


def test_srun_with_several_tasks_per_node_is_refused_not_run_as_separate_trays(tray_env):
    """A plain srun inheriting a job's --ntasks-per-node=2 over 2 nodes: it ran 4 unrelated trays and exited 0."""
    prog = tray_env.script("""
    with tray.init() as rank:
        print("ran", rank.rank, rank.world_size, flush=True)
    """)
    env = tray_env.env()
    env["TRAY_JOB_TOKEN"] = TOKEN
    cmd = ["srun", "-N2", "-n4", "--label", sys.executable, "-m", "tray", "launch", "-n", "2", "--backend", "host",
           "--", sys.executable, str(prog), tray_env.marker]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=str(tray_env.tmp))
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "ran " not in proc.stdout, proc.stdout
    assert proc.stderr.count("this Slurm step runs 4 tasks on 2 nodes; tray needs one task per node") == 4, \
        proc.stderr


def test_srun_failing_rank_named_by_both_nodes(tray_env):
    prog = tray_env.script("""
    with tray.init() as rank:
        rank.barrier()
        if rank.rank == 2:
            sys.exit(7)
        rank.barrier()
    """)
    env = tray_env.env()
    env["TRAY_JOB_TOKEN"] = TOKEN
    cmd = ["srun", "-N2", "--ntasks-per-node=1", "--label", sys.executable, "-m", "tray", "launch", "-n", "2",
           "--backend", "host", "--", sys.executable, str(prog), tray_env.marker]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=str(tray_env.tmp))
    assert proc.returncode != 0 and time.monotonic() - t0 < 60, proc.stdout + proc.stderr
    causes = {}
    for line in proc.stderr.splitlines():
        task, _, rest = line.partition(": ")
        if rest.startswith("tray: FAILED:"):
            causes[task.strip()] = rest
    assert len(causes) == 2 and len(set(causes.values())) == 1, proc.stderr
    cause = next(iter(causes.values()))
    assert "node 1" in cause and "rank 2" in cause and "code 7" in cause, cause
