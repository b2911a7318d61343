"""Modules imported on first use (the standard library's LazyLoader): the head imports zmq, psutil and the wire
format only once its ranks are spawned, so their import time overlaps the ranks' start instead of preceding it."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

# the modules of pyproject's dependencies: a command that cannot import one says how to install them (one line)
DEPENDENCIES = frozenset({"numpy", "msgpack", "zmq", "psutil", "ml_dtypes", "safetensors"})


def lazy_import(name: str) -> ModuleType:
    """Module `name`, loaded when one of its attributes is first read (at once if it is already loaded).
    ImportError now when it cannot be found, as a plain import would."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"No module named {name!r}", name=name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
