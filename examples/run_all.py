"""Run every example on the host backend, as its docstring says to (`make examples`).

    python examples/run_all.py [NAME ...]                  # all, or the named ones; exit 1 if any failed
    python examples/run_all.py --backend cuda [NAME ...]   # the same commands on the GPUs

Each example's docstring holds the line `Run: tray launch ...`; that command is what runs here, with
`tray` and `python` taken from this interpreter (so `.venv/bin/python examples/run_all.py` needs no PATH).
"""

from __future__ import annotations

import ast
import importlib.util
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# in the order a newcomer reads them
EXAMPLES = ("tour", "first_program", "allreduce", "lockstep", "park_wake", "user_kernel", "torch_ep_dispatch")
# example -> the module it needs beyond tray's own dependencies (skipped, and said so, without it)
NEEDS = {"torch_ep_dispatch": "torch"}
# NOTE: a 2-rank host tray starts in ~1 s on 2 cores; 120 s only stops a hang.
TIMEOUT_S = 120.0


def run_line(name: str) -> str:
    """The `tray launch ...` command of example `name`, from its docstring (`Run: ...`) or, for the README's own
    example, its first line (`# NAME.py, started as: ...`). Raises ValueError if absent."""
    text = (HERE / f"{name}.py").read_text()
    doc = ast.get_docstring(ast.parse(text)) or ""
    for line in doc.splitlines():
        if line.startswith("Run: "):
            return line.removeprefix("Run: ").strip()
    first = text.partition("\n")[0]
    if first.startswith(f"# {name}.py, started as: "):
        return first.partition(", started as: ")[2].strip()
    raise ValueError(f"examples/{name}.py: its docstring has no 'Run: tray launch ...' line")


def argv(command: str) -> list[str]:
    """`tray ...` / `python ...` of a documented command, with this interpreter's tray and python."""
    words = shlex.split(command)
    out = [sys.executable, "-m", "tray", *words[1:]] if words[0] == "tray" else words
    return [sys.executable if w == "python" else w for w in out]


def command_for(name: str, backend: str = "host") -> str:
    """Example `name`'s documented command on `backend` (its `--backend host` replaced, or added where it names none:
    the README's tour would otherwise take the GPUs it sees)."""
    command = run_line(name)
    if "--backend" not in command.split():
        command = command.replace("tray launch ", "tray launch --backend host ", 1)
    return command.replace("--backend host", f"--backend {backend}")


def run(name: str, timeout_s: float = TIMEOUT_S, env: dict[str, str] | None = None,
        backend: str = "host") -> subprocess.CompletedProcess[str]:
    """Run example `name` from the repository root with `env` (default: ours) on `backend` (the documented
    command's `--backend host` replaced); output captured (text)."""
    command = command_for(name, backend)
    return subprocess.run(argv(command), cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env)


def main(names: list[str]) -> int:
    backend = "host"
    if names[:1] == ["--backend"] and len(names) >= 2:
        backend, names = names[1], names[2:]
    unknown = sorted(set(names) - set(EXAMPLES))
    if unknown:
        print(f"unknown example(s) {', '.join(unknown)}; known: {', '.join(EXAMPLES)}", file=sys.stderr)
        return 2
    failed = []
    for name in names or EXAMPLES:
        need = NEEDS.get(name)
        if need and importlib.util.find_spec(need) is None:
            print(f"== {name}: skipped: needs {need} (pip install -e '.[{need}]')\n", flush=True)
            continue
        print(f"== {name}: {run_line(name).replace('--backend host', f'--backend {backend}')}", flush=True)
        t0 = time.monotonic()
        proc = run(name, backend=backend)
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            sys.stdout.write(proc.stderr)
            failed.append(name)
        print(f"== {name}: {'ok' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'} "
              f"in {time.monotonic() - t0:.1f} s\n", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
