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

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tray.errors import UsageError

if TYPE_CHECKING:
    from tray.backend.base import Backend, Barrier, Collectives, DeviceBuffer, GroupInfo, PtrTable

# Shared-memory segments (under /dev/shm) the collectives may leave behind when a rank is killed:
# NCCL names its own "nccl-*". The head removes those that appeared during a failed tray.
SHM_PATTERNS = ("nccl-*",)


@dataclass(frozen=True)
class GroupJoin:
    """What joining one group takes: member 0's `join_info`, the group's barrier, and this rank's
    working buffer with every member's mapped (`peer_buffers`, member order); both None when
    `buffer_nbytes` asked for none."""

    group: GroupInfo
    join_info: bytes
    barrier: Barrier
    buffer: DeviceBuffer | None = None
    peer_buffers: PtrTable | None = None


class Joiner(abc.ABC):
    """Joins the groups of one rank on one backend."""

    def buffer_nbytes(self, group: GroupInfo, largest_nbytes: int) -> int:
        """Bytes of the exported per-group working buffer the collectives need; 0 for none.
        `largest_nbytes` is the manifest's largest buffer on this rank."""
        return 0

    @abc.abstractmethod
    def join_info(self, group: GroupInfo) -> bytes:
        """What member 0 of `group` offers for the others to join with (empty when nothing)."""

    @abc.abstractmethod
    def join(self, joins: Sequence[GroupJoin]) -> dict[str, Collectives]:
        """Join every group at once; keyed by group name. The caller owns (closes) the results."""


def for_backend(backend: Backend) -> Joiner:
    """The joiner of `backend` ("host" or "cuda"); UsageError for a backend without collectives."""
    if backend.name == "host":
        from tray.collectives.host import HostJoiner

        return HostJoiner()
    if backend.name == "cuda":
        from tray.collectives.nccl import NcclJoiner

        return NcclJoiner(backend)
    raise UsageError(f"backend {backend.name!r} has no collectives; expected host or cuda")


__all__ = ["SHM_PATTERNS", "GroupJoin", "Joiner", "for_backend"]
