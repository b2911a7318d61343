"""The built-in manifests: the minimal one (the world group alone, for trays launched without a manifest
file) and the ones shipped as package data (`tray._builtin`: `manifests/` of the source tree, with the
CUDA kernels in its `kernels/`), found through `importlib.resources` wherever tray is installed."""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

from tray.errors import UsageError
from tray.manifest.load import parse_manifest
from tray.manifest.schema import Manifest

BUILTIN_PATH = "<builtin>"


def builtin_doc() -> dict[str, Any]:
    """A fresh copy of the built-in manifest document (its digest is over exactly this)."""
    return {
        "format": 1,
        "name": "minimal",
        "description": "the world group and its barrier flags",
        "groups": [{"name": "world", "ranks": "all"}],
    }


def builtin_manifest() -> Manifest:
    """The minimal manifest: the world group; its barrier flags are implicit, as for every group."""
    # NOTE: no kernels, so base_dir is never read; the package data folder keeps it a real directory.
    return parse_manifest(builtin_doc(), BUILTIN_PATH, str(builtin_dir()))


def builtin_dir() -> Path:
    """The folder of the built-in manifests (package data `tray._builtin`).

    Raises UsageError when tray is installed so that its data is not a folder (e.g. run from a zip)."""
    root = importlib.resources.files("tray._builtin")
    if not isinstance(root, Path):
        raise UsageError(f"tray's package data is not a folder ({root!r}); install tray unzipped (pip install)")
    return root


def kernel_dir() -> Path:
    """The folder of the built-in CUDA kernels (`kernels/` of the package data)."""
    return builtin_dir() / "kernels"


def builtin_names() -> tuple[str, ...]:
    """The names of the built-in manifests (file stems), sorted."""
    return tuple(sorted(p.stem for p in builtin_dir().glob("*.json")))


def builtin_path(name: str) -> Path:
    """The file of built-in manifest `name` ("ep_moe" or "ep_moe.json").

    Raises UsageError naming the built-in manifests when there is none of that name."""
    stem = name[:-5] if name.endswith(".json") else name
    path = builtin_dir() / f"{stem}.json"
    if not path.is_file():
        raise UsageError(f"no built-in manifest {name!r}; built-in: {', '.join(builtin_names())}")
    return path
