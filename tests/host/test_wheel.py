"""The wheel carries what the code loads (built-in manifests, their kernels, the barrier kernel), and an
installed wheel runs the gate and reads its built-ins from outside any checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

from tray.backend.cuda.barrier import BARRIER_SOURCE


def _build_wheel(dest: Path) -> Path:
    """`pip wheel .` of a copy of the source tree (a build writes build/ and *.egg-info beside it)."""
    src = dest / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "tray", src / "tray", symlinks=True, ignore=ignore)
    shutil.copytree(REPO / "manifests", src / "manifests", ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src), "-w", str(dest / "dist")],
                   check=True, capture_output=True, text=True, timeout=240)
    (wheel,) = (dest / "dist").glob("tray-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def loaded_files() -> set[str]:
    """Every file under manifests/ the code loads, as package paths: each built-in manifest, the kernel
    sources they name, and the cuda backend's barrier kernel."""
    files = {f"tray/_builtin/kernels/{BARRIER_SOURCE}"}
    for manifest in (REPO / "manifests").glob("*.json"):
        files.add(f"tray/_builtin/{manifest.name}")
        for kernel in json.loads(manifest.read_text()).get("kernels", []):
            files.add(f"tray/_builtin/{kernel['source']}")
    return files


def test_wheel_holds_every_manifest_kernel_and_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert loaded_files() - names == set()
    shipped = {n for n in names if n.endswith((".cu", ".json"))}
    on_disk = {f"tray/_builtin/{p.relative_to(REPO / 'manifests')}" for p in (REPO / "manifests").rglob("*")
               if p.suffix in (".cu", ".json")}
    assert shipped == on_disk
    modules = {str(p.relative_to(REPO)) for p in (REPO / "tray").rglob("*.py") if "_builtin" not in p.parts}
    assert modules - names == set(), "modules missing from the wheel (a package without __init__.py?)"
    assert "tray/py.typed" in names, "the PEP 561 marker is missing: a program's type checker would skip tray"
    stray = sorted(n for n in names if not n.startswith(("tray/", "tray-")) or "__pycache__" in n
                   or n.endswith((".pyc", ".whl", ".so", ".egg-info")))
    assert stray == [], f"the wheel holds what no rank loads: {stray}"


def test_installed_wheel_runs_the_gate_and_inspects_a_builtin_outside_the_checkout(wheel, tray_env, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    bin_dir = venv / "bin"
    site = Path(subprocess.run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
    # The dependencies come from this interpreter's site-packages, behind the venv's own (a .pth line only
    # appends a path: the editable install's finder there is not run, so tray can only come from the wheel).
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "-q",
                              "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stdout + install.stderr
    env = {k: v for k, v in tray_env.env().items() if k != "PYTHONPATH"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=outside, env=env, capture_output=True, text=True, timeout=60)

    where = run(str(bin_dir / "python"), "-c", "import tray; print(tray.__file__)")
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr
    gate = run(str(bin_dir / "tray"), "gate", "peer-barrier", "-n", "2", "--backend", "host", "--iters", "20")
    assert gate.returncode == 0, gate.stdout + gate.stderr
    inspect = run(str(bin_dir / "tray"), "inspect", "tp_mlp")
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    assert "tp_sum_peers" in inspect.stdout and str(site) in inspect.stdout
