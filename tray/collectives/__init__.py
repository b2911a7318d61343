"""Collectives of a group, as a layer between the rank and the backend: NCCL on cuda (nccl.py),
shared memory on host (host.py).

The rank asks `for_backend(backend)` for a `Joiner` and, per group of this rank:
  1. before its offer: `buffer_nbytes(group, largest_nbytes)` bytes of one exported working buffer
     (0: none), which every member maps like any exported buffer; and, when it is member 0,
     `join_info(group)`: opaque bytes it offers to the group (e.g. an NCCL unique id);
  2. after the peer tables: `join(joins)` with member 0's join info, turning every group into its
     `Collectives` at once.
The rank and the head carry join info as bytes and never look inside. Pure at import (the head
imports it); host.py and nccl.py are imported only for their backend.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from tray.collectives.base import GroupJoin, Joiner
from tray.errors import UsageError

if TYPE_CHECKING:
    from tray.backend.base import Backend

# Shared-memory segments (under /dev/shm) the collectives may leave behind when a rank is killed.
# NOTE: NCCL makes its segments with mkstemp("/dev/shm/nccl-XXXXXX"). The launcher records the ones its
# ranks map and removes them once no process uses them (tray/launch/shm.py).
SHM_PATTERNS = ("nccl-*",)
SHM_NAME_RE = re.compile(r"nccl-[A-Za-z0-9]{6}\Z")


def for_backend(backend: Backend) -> Joiner:
    """The joiner of `backend` ("host" or "cuda"); UsageError for a backend without collectives."""
    if backend.name == "host":
        from tray.collectives.host import HostJoiner

        return HostJoiner()
    if backend.name == "cuda":
        from tray.collectives.nccl import NcclJoiner

        return NcclJoiner(backend)
    raise UsageError(f"backend {backend.name!r} has no collectives; expected host or cuda")


__all__ = ["SHM_NAME_RE", "SHM_PATTERNS", "GroupJoin", "Joiner", "for_backend"]
