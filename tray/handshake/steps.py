"""Who takes part in a step that goes through the heads (a vote): the whole job, or one group instance.

A tray-wide step (`exchange`, park, wake) has every rank of the job as its voters. A group step (a
barrier or collective over a group that spans nodes, relayed through the root) is named
`tray:group:<name>@<member 0>:<what>`, and its voters are that instance's members, in member order.
Pure data: the head, the root and the rank all derive the same voters from the topic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

GROUP_PREFIX = "tray:group:"


def group_topic(group: str, members: Sequence[int], what: str) -> str:
    """The topic of step `what` ("barrier", "gather") over the instance of `group` with `members`."""
    return f"{GROUP_PREFIX}{group}@{members[0]}:{what}"


def step_voters(topic: str, world_size: int,
                groups: Mapping[str, Sequence[Sequence[int]]]) -> tuple[int, ...] | None:
    """The ranks that vote on `topic`, in the order their values are returned; None when the topic
    names a group or an instance the manifest does not have."""
    if not topic.startswith(GROUP_PREFIX):
        return tuple(range(world_size))
    name_at, _, _what = topic[len(GROUP_PREFIX):].rpartition(":")
    name, _, leader = name_at.rpartition("@")
    if not leader.isdigit() or name not in groups:
        return None
    for members in groups[name]:
        if members and members[0] == int(leader):
            return tuple(members)
    return None


def spans_nodes(members: Sequence[int], local_world_size: int) -> bool:
    """Whether a group instance has members on more than one node (node of rank r = r // L)."""
    return len({r // local_world_size for r in members}) > 1
