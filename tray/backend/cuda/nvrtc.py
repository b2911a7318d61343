"""Kernel builds of the cuda backend: CUDA C -> CUBIN for the device's arch (NVRTC), cached on disk.

Kernels that touch peer memory (`peers=True`) are also compiled to PTX and refused if it contains NVLink
multicast (`multimem.*`) or a multicast bulk copy: on the machines we run on multicast is off, and a
kernel using it can take a shared host's GPUs out of service.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tray.backend.cuda import driver as drv
from tray.errors import UsageError

_ARCH_FLAGS = ("--gpu-architecture", "-arch")
_MULTIMEM = re.compile(r"(?<![\w.$])multimem\.")
_BULK_MULTICAST = re.compile(r"(?<![\w.$])cp\.(?:reduce\.)?async\.bulk\S*\.multicast")


def find_multicast(ptx_text: str) -> list[str]:
    """The PTX lines (comments dropped, stripped) that use `multimem.*` or a `.multicast` bulk copy."""
    found = []
    for line in ptx_text.splitlines():
        code = line.split("//", 1)[0].strip()
        if code and (_MULTIMEM.search(code) or _BULK_MULTICAST.search(code)):
            found.append(code)
    return found


def refuse_multicast(kernel: str, ptx_text: str) -> None:
    """Raise UsageError naming `kernel` and its first offending PTX line, if it has any."""
    lines = find_multicast(ptx_text)
    if lines:
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise UsageError(
            f"kernel {kernel!r} uses NVLink multicast, which tray refuses in peer kernels: "
            f"PTX line `{lines[0]}`{more}; rewrite it with plain peer loads/stores"
        )


def cache_key(source: str, options: Sequence[str], arch: str) -> str:
    """sha256 hex of (source, options, arch), each part length-prefixed so no two inputs collide."""
    digest = hashlib.sha256()
    for part in (source, "\0".join(options), arch):
        data = part.encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def cache_dir() -> Path:
    """`${TRAY_CACHE_DIR:-~/.cache/tray}/kernels`."""
    root = os.environ.get("TRAY_CACHE_DIR") or str(Path.home() / ".cache" / "tray")
    return Path(root) / "kernels"


def arch_options(options: Sequence[str], arch: str) -> list[str]:
    """`options` with `--gpu-architecture=<arch>` added, unless the caller named an arch already.

    `arch` is `sm_XY` (CUBIN) or `compute_XY` (PTX); a caller's `sm_XY[a]` becomes `compute_XY[a]`
    for PTX, so both builds see the same features.
    """
    virtual = arch.startswith("compute_")
    out: list[str] = []
    named = False
    tokens = list(options)
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        flag, eq, value = tok.partition("=")
        if flag in _ARCH_FLAGS:
            named = True
            if not eq and i + 1 < len(tokens):  # the two-token form: `-arch sm_90`
                i += 1
                value = tokens[i]
            if virtual:
                value = value.replace("sm_", "compute_")
            out.append(f"--gpu-architecture={value}")
        else:
            out.append(tok)
        i += 1
    if not named:
        out.append(f"--gpu-architecture={arch}")
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def compile_cached(source: str, name: str, options: Sequence[str], arch: str) -> bytes:
    """CUBIN (`arch` = `sm_XY`) or PTX (`arch` = `compute_XY`) of `source`, from the cache or NVRTC.

    Raises driver.CompileError (a UsageError, with NVRTC's log) when the source does not compile.
    """
    output = "ptx" if arch.startswith("compute_") else "cubin"
    full = arch_options(options, arch)
    path = cache_dir() / f"{cache_key(source, full, arch)}.{output}"
    try:
        return path.read_bytes()
    except OSError:
        pass
    image = drv.nvrtc_compile(source, name, full, output)
    try:
        _write_atomic(path, image)
    except OSError:  # NOTE: a read-only home only costs a recompile next time
        pass
    return image


@dataclass
class LoadedFunction:
    """A module loaded from a CUBIN and one function of it."""

    module: Any
    function: Any


def load_function(source: str, name: str, entry: str, options: Sequence[str],
                  capability: tuple[int, int], peers: bool, filename: str = "") -> LoadedFunction:
    """Compile (cached), check (peers: no multicast) and load `entry` of `source` for the device.

    `name` is the kernel's name (in errors), `filename` the source's (NVRTC's program name, in its log);
    `capability` is the device's (major, minor). Raises CompileError / UsageError for the source,
    CudaError when the driver refuses the image or the entry is missing (the module is unloaded then).
    """
    major, minor = capability
    program = filename or f"{name}.cu"
    cubin = compile_cached(source, program, options, f"sm_{major}{minor}")
    if peers:
        ptx = compile_cached(source, program, options, f"compute_{major}{minor}")
        refuse_multicast(name, ptx.decode(errors="replace"))
    module = drv.module_load_data(cubin, name)
    try:
        function = drv.module_get_function(module, entry)
    except BaseException:
        drv.module_unload(module)
        raise
    return LoadedFunction(module, function)
