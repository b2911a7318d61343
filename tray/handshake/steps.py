"""Who takes part in a step that goes through the heads (a vote): the whole job, or one group instance.

A tray-wide step (`exchange`, park, wake) has every rank of the job as its voters. A group step (a
barrier or collective over a group that spans nodes, relayed through the root) is named
`tray:group:<name>@<member 0>:<what>`, and its voters are that instance's members, in member order;
for `<what>` = "leaders" (the cross-node step of a hierarchical barrier) only the instance's first
member on each node votes.
Pure data: the head, the root and the rank all derive the same voters from the topic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

from tray.text import is_digits, ranks_text

GROUP_PREFIX = "tray:group:"
# tray's own tray-wide steps, and how a message names them to a user (who never called them by that name)
JOIN_TOPIC = "tray.collectives.join"
PARK_TOPIC = "tray.park"
_OWN_STEPS = {
    JOIN_TOPIC: "the join of the groups' collectives (a rank's first rank.collectives() or program collective op)",
    PARK_TOPIC: "a tray-wide park or wake",
}


# NOTE: the topics whose round counts a rank keeps (Rounds): ~100 B each (about 0.1 MiB in all), against ~100 B per
# topic for the tray's whole life when every topic was kept (10 MiB a rank after 100k exchanges of a topic per step)
ROUNDS_KEPT = 1024


class Rounds:
    """A rank's round numbers of its tray-wide steps, per topic: the k-th use of a topic is its round k, on every rank
    that makes the same steps, and a rank takes only the decision of the round it waits in (one of an earlier round, a
    step it gave up when its timeout passed, is stale).

    Bounded: the counts of the `kept` topics used last. A topic used again after `kept` others starts at round 1
    again, on every rank alike (each rank makes the same steps, so each forgets the same topics at the same step). A
    round given up whose decision has not come is kept beside them, beyond the bound, until that decision comes (read
    and skipped in a later step): the topic's next round is past it, so that a late decision of a round given up is
    never taken for a later one, however many topics came between. Those are one per step given up, as the head keeps
    the votes of such a step."""

    def __init__(self, kept: int = ROUNDS_KEPT) -> None:
        self._last: OrderedDict[str, int] = OrderedDict()  # topic -> its latest round; the topic used last at the end
        self._given_up: dict[str, int] = {}  # topic -> its latest round given up whose decision has not come
        self._kept = kept

    def __len__(self) -> int:
        """The topics whose rounds are kept (the bound's and those given up)."""
        return len(self._last.keys() | self._given_up.keys())

    def next(self, topic: str) -> int:
        """The round `topic`'s next step takes (counted once `begin` says it was made)."""
        return max(self._last.get(topic, 0), self._given_up.get(topic, 0)) + 1

    def begin(self, topic: str, rnd: int) -> None:
        """A step of `topic` in round `rnd` (next()'s) is being made: its vote goes to the head."""
        self._last[topic] = rnd
        self._last.move_to_end(topic)
        if len(self._last) > self._kept:
            self._last.popitem(last=False)

    def gave_up(self, topic: str, rnd: int) -> None:
        """The step of `topic` in round `rnd` ended without its decision (a timeout, an interruption): that decision may
        still come."""
        self._given_up[topic] = rnd

    def skipped(self, topic: str, rnd: int) -> None:
        """A decision not waited for came (and was skipped): the latest round given up of its topic, once it comes,
        needs keeping no more (an earlier round's decision comes before a later one's: every rank votes in them in
        order, over one connection)."""
        if self._given_up.get(topic) == rnd:
            del self._given_up[topic]


def who_waits(ranks: Sequence[int]) -> str:
    """'rank 2 waits' / 'ranks 2,3 wait' for a message."""
    return f"{ranks_text(sorted(ranks))} {'waits' if len(ranks) == 1 else 'wait'}"


def never_joined(waiting: Sequence[int], topic: str, rnd: int) -> str:
    """The end of the message for a rank that left while `waiting` wait for it in round `rnd` of step `topic`."""
    return (f"while {who_waits(waiting)} for it in {describe_step(topic)} (round {rnd}), which it never joined: "
            "every rank must make the same tray-wide steps")


def describe_step(topic: str) -> str:
    """`topic` as a message names it: tray's own steps by what the program did to start them, a group step by
    its group, an exchange by its topic."""
    if topic in _OWN_STEPS:
        return _OWN_STEPS[topic]
    if topic.startswith(GROUP_PREFIX):
        name_at, _, what = topic[len(GROUP_PREFIX):].rpartition(":")
        group = name_at.rpartition("@")[0]
        if what.startswith(PAIR):
            return f"a sendrecv of ranks {what[len(PAIR):].replace('-', ' and ')} (group {group!r}, across nodes)"
        return f"the {what} step of group {group!r} across nodes"
    return f"exchange {topic!r}"


def group_topic(group: str, members: Sequence[int], what: str) -> str:
    """The topic of step `what` ("barrier", "gather") over the instance of `group` with `members`."""
    return f"{GROUP_PREFIX}{group}@{members[0]}:{what}"


LEADERS = "leaders"
PAIR = "pair-"  # `pair-A-B`: a step of two members of the instance alone (a relayed sendrecv), A < B global ranks


def pair_step(a: int, b: int) -> str:
    """The `<what>` of a group step between members `a` and `b` alone (global ranks)."""
    return f"{PAIR}{min(a, b)}-{max(a, b)}"


# NOTE: a rank number in a topic has at most this many digits (int() refuses a string of thousands of them)
_RANK_DIGITS = 18


def _rank_number(text: str) -> int | None:
    """`text` as a rank number: ASCII digits, at most _RANK_DIGITS of them; None when it is not one."""
    return int(text) if is_digits(text) and len(text) <= _RANK_DIGITS else None


def step_voters(topic: str, world_size: int, groups: Mapping[str, Sequence[Sequence[int]]],
                local_world_size: int | None = None) -> tuple[int, ...] | None:
    """The ranks that vote on `topic`, in the order their values are returned; None when the topic
    names a group or an instance the manifest does not have, or a leaders' step without
    `local_world_size` (ranks per node) given."""
    if not topic.startswith(GROUP_PREFIX):
        return tuple(range(world_size))
    name_at, _, what = topic[len(GROUP_PREFIX):].rpartition(":")
    name, _, leader_text = name_at.rpartition("@")
    leader = _rank_number(leader_text)
    if leader is None or name not in groups:
        return None
    for members in groups[name]:
        if members and members[0] == leader:
            if what.startswith(PAIR):
                a, _, b = what[len(PAIR):].partition("-")
                ra, rb = _rank_number(a), _rank_number(b)
                return (ra, rb) if ra is not None and rb is not None and ra < rb and {ra, rb} <= set(members) else None
            if what != LEADERS:
                return tuple(members)
            return None if local_world_size is None else node_leaders(members, local_world_size)
    return None


def node_parts(members: Sequence[int], local_world_size: int) -> tuple[tuple[int, ...], ...]:
    """A group instance split by node (node of rank r = r // L): each node's members in member order,
    nodes in the order of their first member. `node_parts((0, 2, 1, 3), 2) == ((0, 1), (2, 3))`."""
    parts: dict[int, list[int]] = {}
    for r in members:
        parts.setdefault(r // local_world_size, []).append(r)
    return tuple(tuple(p) for p in parts.values())


def node_leaders(members: Sequence[int], local_world_size: int) -> tuple[int, ...]:
    """The first member of a group instance on each node, in node_parts' order."""
    return tuple(p[0] for p in node_parts(members, local_world_size))


def spans_nodes(members: Sequence[int], local_world_size: int) -> bool:
    """Whether a group instance has members on more than one node (node of rank r = r // L)."""
    return len({r // local_world_size for r in members}) > 1


def crossed_steps(boxes: Mapping[tuple[str, int], Mapping[int, object]],
                  voters_of: Callable[[str], Sequence[int] | None],
                  ranks: Iterable[int],
                  waiting: Callable[[tuple[str, int], int], bool] = lambda key, rank: True,
                  ) -> list[tuple[tuple[str, int], int]]:
    """Steps that can never be decided: `boxes` holds each undecided step's votes so far ((topic, round) -> {rank:
    value}); a rank that voted waits in that step until it is decided. A step waits for each of its voters among
    `ranks` that has not voted in it; when such a rank waits in another step, that step must end first. A cycle of
    such waits is a deadlock. Returns one cycle as [(step, the rank it waits for, which waits in the next step)],
    or [] when there is none. A vote `waiting(step, rank)` says no longer waits (its wait ran out: the rank may have
    caught the timeout and gone on) places its rank nowhere: where it waits now, a later vote says; a rank found
    waiting in two steps is judged free. Either way: no false deadlock."""
    if len(boxes) < 2:  # a step waits only for ranks that wait in another: one step alone is no cycle
        return []
    ours = set(ranks)
    where: dict[int, tuple[str, int]] = {}
    twice: set[int] = set()  # ranks judged free: found waiting in two steps
    for key, box in boxes.items():
        for r in box:
            if not waiting(key, r):
                continue
            if r in where:
                twice.add(r)
            else:
                where[r] = key
    waits: dict[tuple[str, int], list[tuple[int, tuple[str, int]]]] = {}
    for key, box in boxes.items():
        voters = voters_of(key[0]) or ()
        waits[key] = [(r, where[r]) for r in voters
                      if r in ours and r not in box and r in where and r not in twice and where[r] != key]
    finished: set[tuple[str, int]] = set()
    # an iterative depth-first walk (a chain of waits may be as long as there are steps): `path` holds, per step on
    # it, the step and the index of its next wait to follow
    for start in boxes:
        if start in finished:
            continue
        path: list[list] = [[start, 0]]
        on_path: dict[tuple[str, int], int] = {start: 0}
        while path:
            frame = path[-1]
            key, i = frame
            if i == len(waits[key]):
                path.pop()
                del on_path[key]
                finished.add(key)
                continue
            frame[1] = i + 1
            _, nxt = waits[key][i]
            if nxt in on_path:  # the cycle: from nxt's place on the path to here, each step with the rank it waits for
                return [(k, waits[k][j - 1][0]) for k, j in path[on_path[nxt]:]]
            if nxt not in finished:
                on_path[nxt] = len(path)
                path.append([nxt, 0])
    return []


# what the error of a rank's wait for a step's decision that ran out holds (HeadClient.receive's "no ..." of a
# "decision on ..." wait: "rank 1: no decision on exchange 'x' from the head ..."): the head and the root know it by it
NO_DECISION = ": no decision on "


def ranks_by_node(ranks: Sequence[int], local_world_size: int) -> str:
    """`ranks` by node (node of rank r = r // L), in their order within a node: "ranks 0,1 (node 0), rank 3 (node
    1)"."""
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(r // local_world_size, []).append(r)
    return ", ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {','.join(map(str, rs))} (node {n})"
                     for n, rs in sorted(by_node.items()))


def describe_pending(topic: str, rnd: int, missing: Sequence[int], local_world_size: int) -> str:
    """The line naming an undecided step and the ranks it still waited for, by node (node of rank r = r // L):
    "tray-wide step: exchange 't' (round 1) was still waiting for ranks 0,1 (node 0), rank 3 (node 1)"."""
    kind = "group step" if topic.startswith(GROUP_PREFIX) else "tray-wide step"
    who = ranks_by_node(missing, local_world_size)
    return f"{kind}: {describe_step(topic)} (round {rnd}) was still waiting for {who}"


def describe_cycle(cycle: Sequence[tuple[tuple[str, int], int]]) -> str:
    """The failure's words for a cycle `crossed_steps` found: each step, the rank it waits for, and where that rank
    waits."""
    links = "; ".join(f"{describe_step(topic)} (round {rnd}) waits for rank {r}, which waits in "
                      f"{describe_step(nxt[0])} (round {nxt[1]})"
                      for ((topic, rnd), r), (nxt, _) in zip(cycle, [*cycle[1:], *cycle[:1]]))
    return (f"the ranks wait in steps that wait for one another, so none can ever end: {links}. Every rank must make "
            "the same tray-wide steps (exchange topics, collectives' first use, park/wake) in the same order")
