"""The built-in manifest: the world group alone, for trays launched without a manifest file."""

from __future__ import annotations

import os
from typing import Any

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
    # NOTE: no kernels, so base_dir is never read; the cwd only keeps the argument a real directory.
    return parse_manifest(builtin_doc(), BUILTIN_PATH, os.getcwd())
