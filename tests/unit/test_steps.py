"""The crossed-steps search (tray/handshake/steps.py): cycles of steps that wait for one another's ranks; a rank's round
numbers per topic (Rounds)."""

from __future__ import annotations

from tray.handshake.steps import Rounds, crossed_steps, group_topic, step_voters

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


def made(rounds: Rounds, topic: str) -> int:
    rnd = rounds.next(topic)
    rounds.begin(topic, rnd)
    return rnd


def test_rounds_count_each_topic_and_keep_the_topics_used_last():
    """A topic per step kept every topic's count for the tray's life (100k exchanges: 10 MiB a rank). The counts of the
    `kept` topics used last stay (a topic in use keeps counting); one used again after `kept` others starts at 1, as it
    does on every rank that made the same steps."""
    rounds = Rounds(kept=3)
    assert [made(rounds, "step") for _ in range(3)] == [1, 2, 3]
    for i in range(100):
        assert made(rounds, f"step-{i}") == 1
        if i % 2:
            assert made(rounds, "step") == 4 + i // 2  # used every other step: never forgotten
    assert len(rounds) == 3
    other = Rounds(kept=3)
    assert [made(other, "x"), made(other, "a"), made(other, "b"), made(other, "c"), made(other, "x")] == [1, 1, 1, 1, 1]


def test_a_round_given_up_is_never_reused_until_its_decision_came_whatever_came_between():
    """A rank that gave up round 1 of 'x' (its timeout) takes round 2 next, so that the decision of round 1, should it
    still come, is skipped as stale; forgetting 'x' among many topics must not bring round 1 back before that decision
    came. Once it came (skipped in a later step), 'x' is forgotten like any topic."""
    rounds = Rounds(kept=2)
    assert made(rounds, "x") == 1
    rounds.gave_up("x", 1)
    for i in range(10):
        made(rounds, f"t-{i}")
    assert rounds.next("x") == 2 and len(rounds) == 3  # kept beyond the bound
    rounds.skipped("x", 1)  # its decision came at last
    assert rounds.next("x") == 1 and len(rounds) == 2
    assert made(rounds, "y") == 1
    rounds.gave_up("y", 1)
    assert made(rounds, "y") == 2  # the retry: round 1's decision is stale to it
    rounds.gave_up("y", 2)
    rounds.skipped("y", 1)  # round 1's decision: round 2's may still come
    for i in range(10):
        made(rounds, f"u-{i}")
    assert rounds.next("y") == 3
    rounds.skipped("y", 2)
    assert rounds.next("y") == 1
