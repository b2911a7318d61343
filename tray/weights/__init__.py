"""Weights from safetensors files into manifest buffers that carry a `bind` (schema: tray/weights/bind.py).

report = tray.weights.load_weights(rank)    # after tray.init(); every bound buffer, checked, then loaded
print(report.nbytes, report.gbps)
"""

from tray.weights.bind import ResolvedBind, resolve_bind
from tray.weights.loader import (
    BindTarget,
    Piece,
    WeightsReport,
    copy_pieces,
    load_targets,
    load_weights,
    plan_target,
)
from tray.weights.safetensors import CheckpointError, SafetensorsHeader, TensorEntry, read_header

__all__ = [
    "BindTarget",
    "CheckpointError",
    "Piece",
    "ResolvedBind",
    "SafetensorsHeader",
    "TensorEntry",
    "WeightsReport",
    "copy_pieces",
    "load_targets",
    "load_weights",
    "plan_target",
    "read_header",
    "resolve_bind",
]
