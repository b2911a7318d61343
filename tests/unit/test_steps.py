"""The crossed-steps search (tray/handshake/steps.py): cycles of steps that wait for one another's ranks."""

from __future__ import annotations

from tray.handshake.steps import crossed_steps, group_topic, step_voters

WORLD = 4


def voters(topic: str):
    return step_voters(topic, WORLD, {"pairs": ((0, 2), (1, 3))}, 2)


def test_two_exchanges_each_waiting_for_the_others_ranks_are_a_cycle():
    boxes = {("a", 1): {0: 1, 1: 1}, ("b", 1): {2: 1, 3: 1}}
    cycle = crossed_steps(boxes, voters, range(WORLD))
    assert {step for step, _ in cycle} == {("a", 1), ("b", 1)}
    for (step, rank), (nxt, _) in zip(cycle, [*cycle[1:], *cycle[:1]]):
        assert rank not in boxes[step] and rank in boxes[nxt]  # each link: a rank the step lacks, waiting in the next


def test_ranks_not_heard_from_anywhere_make_no_cycle():
    assert crossed_steps({("a", 1): {0: 1, 1: 1}}, voters, range(WORLD)) == []


def test_a_vote_whose_wait_ran_out_places_its_rank_nowhere():
    """Ranks 0 and 1 gave 'a' up (their waits ran out) and wait in 'c'; ranks 2 and 3 wait in 'b': the cycle is
    'b' and 'c', whatever 'a' still holds."""
    boxes = {("a", 1): {0: 1, 1: 1}, ("c", 1): {0: 1, 1: 1}, ("b", 1): {2: 1, 3: 1}}
    cycle = crossed_steps(boxes, voters, range(WORLD), lambda step, rank: step != ("a", 1))
    assert {step for step, _ in cycle} == {("b", 1), ("c", 1)}
    # both counted as waiting: ranks 0 and 1 in two steps at once are judged free, so no cycle is claimed
    assert crossed_steps(boxes, voters, range(WORLD)) == []


def test_a_group_step_crossing_an_exchange_is_a_cycle_and_ranks_outside_are_not_judged():
    pair = group_topic("pairs", (0, 2), "gather")
    boxes = {(pair, 1): {0: None}, ("x", 1): {1: 1, 2: 1, 3: 1}}
    cycle = crossed_steps(boxes, voters, range(WORLD))
    assert dict(cycle) == {(pair, 1): 2, ("x", 1): 0}
    assert crossed_steps(boxes, voters, range(2)) == []  # rank 2 is not among those judged


def test_a_chain_of_waits_longer_than_the_recursion_limit_is_walked():
    """3000 steps, step k held by rank k and waiting for rank k + 1 (in step k + 1): a chain with no cycle, then
    closed into one by the last step waiting for rank 0. The walk was recursive: a RecursionError in the root."""
    n = 3000
    boxes = {(f"s{k}", 1): {k: None} for k in range(n)}

    def chain(topic: str):
        k = int(topic[1:])
        return (k, k + 1)

    assert crossed_steps(boxes, chain, range(n + 1)) == []

    def ring(topic: str):
        k = int(topic[1:])
        return (k, (k + 1) % n)

    cycle = crossed_steps(boxes, ring, range(n))
    assert len(cycle) == n and dict(cycle)[("s0", 1)] == 1 and dict(cycle)[(f"s{n - 1}", 1)] == 0
