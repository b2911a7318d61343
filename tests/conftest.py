"""Real multi-process trays on the host backend: run `tray launch` as a subprocess and check that it
leaves no process, socket, job dir or shared-memory segment behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tray.launch.shm import in_use

# NOTE: segments a test plants in /dev/shm with NCCL's name pattern and leaves unmapped on purpose for a while (a killed
# tray's, for the next launch's sweep): each is marked here while it exists, so that another test running beside it
# (`make test` runs test files side by side) does not count it among its own leftovers
PLANTED = Path(tempfile.gettempdir()) / f"tray-tests-planted-{os.getuid()}"


def planted_segments() -> set[str]:
    """The names of the segments tests have planted and not yet removed."""
    try:
        return set(os.listdir(PLANTED))
    except OSError:
        return set()


@contextlib.contextmanager
def planted_segment(name: str):
    """Mark /dev/shm/`name` as a test's own while the block runs; remove the segment, then the mark, after it."""
    PLANTED.mkdir(mode=0o700, exist_ok=True)
    mark = PLANTED / name
    mark.touch()
    try:
        yield name
    finally:
        Path("/dev/shm", name).unlink(missing_ok=True)
        mark.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # another test's mark may still be there: its test removes the directory
            PLANTED.rmdir()

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"


def _tray_from_checkout() -> bool:
    import tray

    return Path(tray.__file__).resolve().parent.parent == REPO


_TRAY_FROM_CHECKOUT = _tray_from_checkout()


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            pass
    return found


class Tray:
    """Launches trays for one test; on teardown asserts nothing was left behind."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        # NOTE: short, not under tmp_path: socket paths under it must fit a UNIX socket's 107 bytes, and pytest's
        # temp dirs (longer with a worker's popen-gwN, a long user name) leave a job dir too little room
        self.jobs_root = Path(tempfile.mkdtemp(prefix="tray-jobs-", dir="/tmp" if os.path.isdir("/tmp") else None))
        self.marker = f"traytest-{uuid.uuid4().hex[:12]}"
        self.shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["TRAY_JOBS_ROOT"] = str(self.jobs_root)
        if _TRAY_FROM_CHECKOUT:  # an installed tray (GPU runs of the wheel) is tested as installed
            # NOTE: no empty entry: it would put each process's working directory on its sys.path
            env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
        return env

    def script(self, body: str) -> Path:
        path = self.tmp / f"prog_{uuid.uuid4().hex[:8]}.py"
        path.write_text("import os, sys, time\nimport numpy as np\nimport tray\n" + textwrap.dedent(body))
        return path

    def command(self, n: int, body: str, *launch_args: str, backend: str = "host") -> list[str]:
        prog = self.script(body)
        return [sys.executable, "-m", "tray", "launch", "-n", str(n), "--backend", backend, *launch_args,
                "--", sys.executable, str(prog), self.marker]

    def launch(self, n: int, body: str, *launch_args: str, timeout_s: float = 60.0, backend: str = "host") -> Run:
        return self.run(self.command(n, body, *launch_args, backend=backend), timeout_s)

    def run(self, cmd: list[str], timeout_s: float = 60.0, env: dict[str, str] | None = None) -> Run:
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env or self.env(),
                              cwd=str(self.tmp))
        return Run(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)

    def leftovers(self) -> list[str]:
        # NOTE: the command line read when the process was found: asking again races with its exit
        # (a process that became a zombie in between raised ZombieProcess here).
        left = [f"process {p.pid}: {' '.join(p.info['cmdline'] or [])}" for p in _marked(self.marker)]
        left += [f"job dir {d}" for d in self.jobs_root.iterdir()]
        if os.path.isdir("/dev/shm"):
            made = set(os.listdir("/dev/shm")) - self.shm_before
            if made:  # a segment another live process maps or holds open is its own, not one this test left (one
                # this process holds still counts): another test's tray still running beside this one (`make test`
                # runs test files side by side)
                made -= {os.path.basename(p) for p in in_use({f"/dev/shm/{s}" for s in made}, but=os.getpid())}
                made -= planted_segments()  # another test's, left unmapped on purpose for a while
            left += [f"shm {s}" for s in made]
        return left

    def cleanup(self) -> None:
        for p in _marked(self.marker):
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass


@pytest.fixture
def tray_env(tmp_path: Path):
    t = Tray(tmp_path)
    try:
        yield t
        # NOTE: 10 s, not less: a segment another test file's killed tray leaves on purpose (test_fault_matrix) lives
        # until that test's next launch removes it, seconds later on 2 loaded cores, and /dev/shm is shared; a real
        # leftover stays for good, so the wait costs a clean test nothing and a leaking one 10 s
        deadline = time.monotonic() + 10.0
        while t.leftovers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert t.leftovers() == [], "the tray left things behind"
    finally:
        t.cleanup()
        shutil.rmtree(t.jobs_root, ignore_errors=True)


@pytest.fixture(scope="module")
def isolated_kernel_cache(tmp_path_factory):
    """TRAY_CACHE_DIR pointed at a fresh directory for one module's in-process kernel loads (every kernel
    compiled by NVRTC here, none taken from an earlier run), put back afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAY_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))
        yield


def visible_gpus() -> int:
    try:
        from tray.backend.cuda import visible_gpu_count
    except ImportError:
        return 0
    return visible_gpu_count()


def gpus_shared() -> bool:
    """TRAY_SHARE_GPUS=1: the GPU tests' ranks take turns on fewer GPUs (the multi-rank paths checked on one GPU);
    their checks hold, their timings mean nothing, so a test skips what it asserts of a time."""
    from tray.envvars import share_gpus

    return share_gpus(None, os.environ.get("TRAY_SHARE_GPUS"))


def gpu_ranks(limit: int = 4) -> int:
    """How many ranks a GPU test runs: one per visible GPU up to `limit`; with ranks sharing GPUs (`gpus_shared`)
    `limit` whenever a GPU is visible."""
    gpus = visible_gpus()
    return limit if gpus and gpus_shared() else min(limit, gpus)


def slurm_cluster() -> str | None:
    """None when a Slurm cluster answers `sinfo`; otherwise why not."""
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%D"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no Slurm cluster reachable (sinfo: {exc}); start one: launch/slurm/local-cluster.sh start"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return f"no Slurm cluster reachable (sinfo: {last}); start one: launch/slurm/local-cluster.sh start"
    return None


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip only when no GPU is visible; `cluster` tests when no Slurm cluster answers."""
    wanted = {k for item in items for k in ("gpu", "cluster") if k in item.keywords}
    if "gpu" in wanted and visible_gpus() == 0:
        skip = pytest.mark.skip(reason="no GPU visible")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    why = slurm_cluster() if "cluster" in wanted else None
    if why:
        for item in items:
            if "cluster" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))
