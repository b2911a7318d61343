"""The ready-made launch scripts in launch/ run as their README says."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "launch" / "single-host.sh"


def test_single_host_runs_a_program_on_every_rank_with_multicast_off(tray_env):
    body = """
for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    assert os.environ[key] in ("0", "1"), key
with tray.init() as rank:
    print("up", rank.rank, os.environ["NCCL_NVLS_ENABLE"])
"""
    prog = tray_env.script(body)
    env = {**tray_env.env(), "PYTHON": sys.executable}
    run = subprocess.run([str(SCRIPT), "-n", "2", "--backend", "host", "--", sys.executable, str(prog),
                          tray_env.marker], capture_output=True, text=True, timeout=60, env=env, cwd=tray_env.tmp)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(line.split("] ", 1)[1] for line in run.stdout.splitlines() if "] up " in line) == [
        "up 0 0", "up 1 0"]


def test_single_host_gate_qualifies_the_box(tray_env):
    env = {**tray_env.env(), "PYTHON": sys.executable}
    run = subprocess.run([str(SCRIPT), "--gate", "-n", "2", "--backend", "host", "--iters", "20"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=tray_env.tmp)
    assert run.returncode == 0 and "PASSED" in run.stdout, run.stdout + run.stderr
