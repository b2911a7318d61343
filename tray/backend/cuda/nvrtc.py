"""Kernel builds of the cuda backend: CUDA C -> CUBIN for the device's arch (NVRTC), cached on disk.

Kernels that touch peer memory (`peers=True`) are also compiled to PTX and refused if it contains NVLink
multicast (`multimem.*`) or a multicast bulk copy: on the machines we run on multicast is off, and a
kernel using it can take a shared host's GPUs out of service.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import sys
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
    """`$TRAY_CACHE_DIR/kernels`, else `$XDG_CACHE_HOME/tray/kernels` (an absolute XDG_CACHE_HOME, as the XDG base
    directory spec has it), else `~/.cache/tray/kernels`."""
    root = os.environ.get("TRAY_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        root = str(Path(xdg if os.path.isabs(xdg) else Path.home() / ".cache") / "tray")
    return Path(root) / "kernels"


_untrusted_said: set[Path] = set()


def _untrusted(directory: Path) -> str | None:
    """Why the cache `directory` must not be read (another user could have put a CUBIN there that this process
    would load as the kernel it asked for), or None: it is this user's and no one else may write in it. A missing
    one is made 0700 when a build is written."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    # NOTE: a sticky bit does not help here: another user may still add a file under a name not yet written. A
    # group-writable one is accepted for a user-private group alone (umask 002 under UPG), as the jobs root's is: a
    # primary group other users share ("users") lets them rename this user's builds under each other's names
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (os.getuid(), 0):
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if mode & stat.S_IWOTH:
        return f"has mode {mode:04o}: anyone may write in it"
    if mode & stat.S_IWGRP:
        from tray.launch.jobdir import private_group

        if not private_group(st.st_gid):
            return f"has mode {mode:04o}: its group (gid {st.st_gid}) may write in it"
    return None


def _read_own(path: Path) -> bytes | None:
    """The bytes of the cache file `path` when it is a regular file of this user or root (not a link), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.getuid(), 0):
            return None
        return f.read()


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
    path.parent.parent.mkdir(parents=True, exist_ok=True)
    path.parent.mkdir(mode=0o700, exist_ok=True)  # NOTE: mode is not applied to an existing dir: _untrusted judges it
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
    directory = cache_dir()
    path = directory / f"{cache_key(source, full, arch)}.{output}"
    why = _untrusted(directory)
    if why is None:
        cached = _read_own(path)
        if cached is not None:
            return cached
    elif directory not in _untrusted_said:
        _untrusted_said.add(directory)
        print(f"tray: the kernel cache {directory} {why}: it is neither read nor written, so every kernel is "
              "compiled anew; set TRAY_CACHE_DIR to a directory of your own (mode 0700)", file=sys.stderr, flush=True)
    image = drv.nvrtc_compile(source, name, full, output)
    if why is None:
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
