"""The prewarm wrapper runs a program exactly as `python` would, and only wraps Python commands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tray.launch.spawn import prewarmed

REPO = Path(__file__).resolve().parents[2]


def test_only_python_programs_are_wrapped():
    assert prewarmed(("python3", "prog.py", "a")) == ("python3", "-m", "tray.rank.prewarm", "prog.py", "a")
    assert prewarmed(("/usr/bin/python3.12", "-m", "pkg.mod")) == (
        "/usr/bin/python3.12", "-m", "tray.rank.prewarm", "-m", "pkg.mod")
    assert prewarmed(("python3", "-u", "prog.py")) == ("python3", "-u", "prog.py")  # interpreter flags: as given
    assert prewarmed(("bash", "-c", "echo")) == ("bash", "-c", "echo")
    assert prewarmed(("python3",)) == ("python3",)


def _run(args: list[str], cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), TRAY_BACKEND="host")
    out = subprocess.run([sys.executable, "-m", "tray.rank.prewarm", *args], capture_output=True, text=True,
                         timeout=30, env=env, cwd=str(cwd), check=True)
    return out.stdout


def test_script_module_and_code_run_as_python_would(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    probe = "import sys; print(__name__, sys.argv[1:], repr(sys.path[0]))"
    (pkg / "mod.py").write_text(probe + "\n")
    script = tmp_path / "sub" / "prog.py"
    script.parent.mkdir()
    script.write_text(probe + "\n")
    assert _run([str(script), "x", "y"], tmp_path).split(" ", 1) == [
        "__main__", f"['x', 'y'] {str(script.parent)!r}\n"]
    assert _run(["-m", "pkg.mod", "z"], tmp_path).startswith("__main__ ['z']")
    assert _run(["-c", probe, "w"], tmp_path) == "__main__ ['w'] ''\n"
