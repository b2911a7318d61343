"""Manifests: the JSON a tray runs (groups, vars, buffers, states, kernels, programs), as checked data.

Pure data: imports only the standard library and tray.errors (no numpy, no zmq, no backend).
"""

from __future__ import annotations

from tray.manifest.builtin import builtin_manifest
from tray.manifest.digest import canonical_json, compute_digest
from tray.manifest.inspect import format_inspect, human_bytes
from tray.manifest.load import load_manifest, parse_manifest
from tray.manifest.schema import (
    COLLECTIVES,
    DTYPE_ITEMSIZE,
    FORMAT_VERSION,
    OP_TYPES,
    BarrierSpec,
    BufferRef,
    BufferSpec,
    CollectiveSpec,
    CopySpec,
    GemmSpec,
    GroupSpec,
    KernelSpec,
    LaunchSpec,
    Manifest,
    OpSpec,
    ProgramSpec,
    ResolvedArg,
    ResolvedBarrier,
    ResolvedBuffer,
    ResolvedCollective,
    ResolvedCopy,
    ResolvedGemm,
    ResolvedLaunch,
    ResolvedManifest,
    ResolvedOp,
    ResolvedProgram,
    ResolvedState,
    StateSpec,
)

__all__ = [
    "COLLECTIVES",
    "DTYPE_ITEMSIZE",
    "FORMAT_VERSION",
    "OP_TYPES",
    "BarrierSpec",
    "BufferRef",
    "BufferSpec",
    "CollectiveSpec",
    "CopySpec",
    "GemmSpec",
    "GroupSpec",
    "KernelSpec",
    "LaunchSpec",
    "Manifest",
    "OpSpec",
    "ProgramSpec",
    "ResolvedArg",
    "ResolvedBarrier",
    "ResolvedBuffer",
    "ResolvedCollective",
    "ResolvedCopy",
    "ResolvedGemm",
    "ResolvedLaunch",
    "ResolvedManifest",
    "ResolvedOp",
    "ResolvedProgram",
    "ResolvedState",
    "StateSpec",
    "builtin_manifest",
    "canonical_json",
    "compute_digest",
    "format_inspect",
    "human_bytes",
    "load_manifest",
    "parse_manifest",
]
