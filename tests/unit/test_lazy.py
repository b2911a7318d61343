"""tray.lazy: a module loaded on first use; what the head imports before it spawns its ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tray.lazy import lazy_import


def test_a_lazy_module_loads_on_first_attribute_and_unknown_names_fail_now():
    code = ("import sys; from tray.lazy import lazy_import; m = lazy_import('json.tool'); "
            "print(hasattr(m, 'main'), 'json.tool' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stderr
    assert lazy_import("sys") is sys  # already loaded: the module itself
    with pytest.raises(ImportError, match="no_such_module_here"):
        lazy_import("no_such_module_here")


def test_the_head_module_imports_no_zmq_psutil_or_wire_until_used():
    code = ("import sys; import tray.launch.head, tray.cli; "  # type() reads no attribute: nothing loads
            "print(*[type(sys.modules[m]).__name__ for m in ('zmq', 'psutil', 'tray.handshake.wire')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["_LazyModule"] * 3, out.stdout + out.stderr


def test_a_one_host_launch_loads_neither_the_root_nor_zeromq_nor_asyncio_to_check_its_options():
    """`tray launch` on one host reads its job options (tray.cli._job_of) without the multi-node root's module, which
    brings ZeroMQ, its monitor and asyncio (about 0.1 s of a head's start)."""
    code = ("import sys; import tray.cli; args = tray.cli.build_parser('launch').parse_args(['launch', '-n', '2', "
            "'--', 'true']); print(tray.cli._job_of(args), *[m in sys.modules for m in "
            "('tray.launch.root', 'asyncio', 'tray.handshake.jobwire')])")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "LWS_"))}  # one host
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.split() == ["None", "False", "False", "False"], out.stdout + out.stderr


def test_the_head_start_imports_neither_numpy_nor_the_rank_nor_the_programs():
    """What `tray launch` loads before its first spawn stays light: no numpy, tray.rank, bench parsers or CUDA."""
    code = ("import sys; import tray.cli, tray.launch.head, tray.launch.pick; tray.cli.build_parser('launch'); "
            "print(*[m in sys.modules for m in ('numpy', 'tray.rank', 'tray.programs', 'cuda')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False"] * 4, out.stdout + out.stderr
