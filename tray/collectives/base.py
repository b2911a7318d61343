"""The collectives layer's types: what joining a group takes (`GroupJoin`) and who joins (`Joiner`)."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

# the size of an NCCL unique id: the join info member 0 of an NCCL group hands the others
UNIQUE_ID_NBYTES = 128

if TYPE_CHECKING:
    from tray.backend.base import Barrier, Collectives, DeviceBuffer, GroupInfo, PtrTable


@dataclass(frozen=True)
class GroupJoin:
    """What joining one group takes: member 0's `join_info`, the group's barrier, and this rank's
    working buffer with every member's mapped (`peer_buffers`, member order); both None when
    `buffer_nbytes` asked for none. `wait_s`: how long a collective that waits for the other members on the
    host (the host backend's) waits: the rank's barrier timeout (None: the barrier's default).

    NOTE: imports nothing at run time beyond the standard library: the NCCL id process imports this module."""

    group: GroupInfo
    join_info: bytes
    barrier: Barrier
    buffer: DeviceBuffer | None = None
    peer_buffers: PtrTable | None = None
    wait_s: float | None = None


class Joiner(abc.ABC):
    """Joins the groups of one rank on one backend."""

    # Whether its collectives work between nodes of a job (without peer mappings); where not, a group
    # that spans nodes gets relayed collectives (tray/collectives/relay.py).
    crosses_nodes: bool = False

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

    def adopt(self, joins: Sequence[GroupJoin], joined: dict[str, Collectives]) -> dict[str, Collectives]:
        """Collectives joined before the rank was wired (tray/collectives/early.py), made ready for `joins`
        (e.g. given the rank's stream). Only joiners that join early override this."""
        raise NotImplementedError(f"{type(self).__name__} does not join early")
