"""torchrun's contract under `tray launch`: a gloo program from env:// next to tray.init(), a script run
without `python`, and a MASTER_PORT of its own for each of two trays running at once."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

_GLOO = """
import torch
import torch.distributed as dist
for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
    assert os.environ.get(key), key
assert os.environ["GROUP_RANK"] == "0" and os.environ["MASTER_ADDR"] == "127.0.0.1"
assert os.environ["LOCAL_WORLD_SIZE"] == os.environ["WORLD_SIZE"] == os.environ["ROLE_WORLD_SIZE"]
dist.init_process_group("gloo")                           # env:// as under torchrun
with tray.init() as rank:
    assert dist.get_rank() == rank.rank and dist.get_world_size() == rank.world_size
    t = torch.full((4,), float(rank.rank + 1))
    dist.all_reduce(t)
    n = rank.world_size
    assert t.tolist() == [n * (n + 1) / 2] * 4, t
    rank.barrier()
    print("gloo and tray ok", os.environ["MASTER_PORT"])
dist.destroy_process_group()
"""


def test_gloo_program_from_env_with_tray_init_as_a_bare_script(tray_env):
    pytest.importorskip("torch", reason="torch (CPU) is installed by `make test`; this run has none")
    prog = tray_env.script(_GLOO)
    # no `--` and no `python`: a .py file runs with the launcher's Python, as under torchrun
    run = tray_env.run([sys.executable, "-m", "tray", "launch", "-n", "2", "--backend", "host", str(prog),
                        tray_env.marker], timeout_s=120)
    assert run.returncode == 0, run.output
    assert run.stdout.count("gloo and tray ok") == 2, run.output


def test_two_trays_at_once_get_different_master_ports(tray_env):
    meeting = tray_env.tmp / "ports"
    meeting.mkdir()
    body = f"""
port = os.environ["MASTER_PORT"]
(__import__("pathlib").Path({str(meeting)!r}) / f"{{os.getpid()}}").write_text(port)
deadline = time.monotonic() + 30
while len(os.listdir({str(meeting)!r})) < 4:            # every rank of both trays is up at once
    assert time.monotonic() < deadline, "the other tray never came up"
    time.sleep(0.02)
print("port", port)
"""
    procs = [subprocess.Popen(tray_env.command(2, body), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=tray_env.env(), cwd=str(tray_env.tmp)) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, out + err
        outs.append({line.split()[-1] for line in out.splitlines() if " port " in line})
    assert len(outs[0]) == 1 and len(outs[1]) == 1, outs  # one port per tray, seen by all its ranks
    assert outs[0] != outs[1], outs


def test_script_must_exist_to_run_bare(tray_env):
    run = tray_env.run([sys.executable, "-m", "tray", "launch", "-n", "1", "--backend", "host", "missing.py"])
    assert run.returncode != 0
    assert "missing.py" in run.stderr


def test_reserved_port_is_kept_from_other_binds():
    import socket

    from tray.launch.ports import PortReservation

    with PortReservation() as held:
        other = socket.socket()
        try:
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", held.port))
        finally:
            other.close()
        t0 = time.monotonic()
        picked = set()
        while time.monotonic() - t0 < 0.5:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            picked.add(s.getsockname()[1])
            s.close()
        assert held.port not in picked


def test_launch_takes_a_builtin_name(tray_env):
    run = tray_env.launch(2, """
with tray.init() as rank:
    print("buffer", rank.buffer("fill").shape)
""", "--manifest", "peer_fill")
    assert run.returncode == 0, run.output
    assert run.stdout.count("buffer (8192,)") == 2, run.output


def test_torchruns_module_and_no_python_and_spellings(tray_env):
    """`-m MODULE` runs `python -m MODULE` with this Python (its directory, the working one, on the path, as python
    -m puts it); `--no-python` runs an executable .py file as the command it is; torchrun's underscore spellings
    and its one-node rendezvous flags are taken."""
    (tray_env.tmp / "trainpkg").mkdir()
    (tray_env.tmp / "trainpkg" / "__init__.py").write_text("")
    (tray_env.tmp / "trainpkg" / "train.py").write_text(
        "import os, sys\nimport tray\nwith tray.init() as rank:\n"
        "    print('module ok', rank.rank, __name__, sys.argv[1:], flush=True)\n")
    run = tray_env.run([sys.executable, "-m", "tray", "launch", "--nproc_per_node", "2", "--backend", "host",
                        "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--max_restarts", "0",
                        "-m", "trainpkg.train", "--lr", "0.1", tray_env.marker])
    assert run.returncode == 0, run.output
    for r in (0, 1):
        assert f"module ok {r} __main__ ['--lr', '0.1', '{tray_env.marker}']" in run.stdout, run.output
    assert "note" not in run.stderr, run.stderr   # c10d is what tray does: nothing to say
    script = tray_env.tmp / "direct.py"
    script.write_text("#!/bin/sh\necho \"direct $TRAY_RANK\"\n")
    script.chmod(0o755)
    run = tray_env.run([sys.executable, "-m", "tray", "launch", "-n", "2", "--backend", "host", "--no-python",
                        str(script), tray_env.marker])
    assert run.returncode == 0, run.output
    assert "direct 0" in run.stdout and "direct 1" in run.stdout, run.output


def test_a_failed_trays_multiprocessing_semaphores_are_unlinked(tray_env):
    """A rank stopped by the teardown leaves its spawn-context semaphores (/dev/shm/sem.mp-*) to multiprocessing's
    resource tracker, which ignores SIGTERM and unlinks them once its last client (the rank, its workers) is gone:
    as under torchrun, the tracker must get that chance before the tray's process group is SIGKILLed. The fixture
    checks that no /dev/shm entry is left."""
    run = tray_env.launch(2, """
import multiprocessing as mp
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    locks = [ctx.Lock() for _ in range(3)]                  # named POSIX semaphores, tracked
    worker = ctx.Process(target=time.sleep, args=(60,), daemon=True)   # holds the tracker's pipe, as a DataLoader's
    worker.start()
    with tray.init() as rank:
        rank.barrier()
        if rank.rank == 1:
            raise RuntimeError("fails on purpose")
        time.sleep(60)
""", timeout_s=120)
    assert run.returncode == 1, run.output
    assert "rank 1 reported RuntimeError: fails on purpose" in run.stderr, run.output
