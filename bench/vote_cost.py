"""The head's cost per vote with steps given up: a head of one host (tray.launch.head.Head, no ranks started) is sent
K votes of a step its rank gave up at once (a 1 ms wait, a caught timeout, as a program that polls a step in a loop
leaves them: each stays until its round is decided, the round never reused), then timed over votes that leave a
step undecided (each runs the head's deadlock check). In-process: the head's own handling, no transport.

    python bench/vote_cost.py [--given-up 0,1000,10000] [--votes 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tray.envinfo import environment
from tray.handshake import wire
from tray.launch.head import Head
from tray.launch.spec import RankProcess, TraySpec


def per_vote_us(given_up: int, votes: int) -> float:
    """µs per vote of rank 0 in a two-rank head holding `given_up` steps rank 0 gave up (the median of 5 passes)."""
    head = Head(TraySpec(nprocs=2, cmd=("true",), backend="host"))
    head.procs = [RankProcess(rank=r, popen=SimpleNamespace(pid=1 << 22, poll=lambda: None),  # type: ignore[arg-type]
                              t_spawn=time.time()) for r in range(2)]

    def vote(topic: str, rnd: int, wait_s: float) -> None:
        head._on_vote(None, wire.Vote(token=head.token, rank=0, topic=topic, round=rnd, value=0,  # type: ignore[arg-type]
                                      wait_s=wait_s))

    for rnd in range(1, given_up + 1):
        vote("poll", rnd, 0.001)
    time.sleep(0.01)  # their waits run out
    passes, rnd = [], 0
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(votes):
            rnd += 1
            vote("step", rnd, 60.0)
            head.votes.pop(("step", rnd))  # decided, as rank 1's vote would: the box stays at the given-up ones
            head._forget_waits(("step", rnd))
        passes.append((time.perf_counter() - t0) / votes * 1e6)
    assert head.failure is None
    return statistics.median(passes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--given-up", default="0,1000,10000", help="steps given up before the timed votes, comma-separated")
    ap.add_argument("--votes", type=int, default=200, help="timed votes per pass (5 passes, the median)")
    ap.add_argument("--json", default=None, help="write the figures here (with the environment)")
    a = ap.parse_args(argv)
    rows = []
    for k in (int(x) for x in a.given_up.split(",")):
        us = per_vote_us(k, a.votes)
        rows.append({"given_up": k, "us_per_vote": round(us, 2)})
        print(f"{k:>7} steps given up: {us:9.1f} us per vote", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"bench": "vote_cost", "votes": a.votes, "runs": rows,
                                            "environment": environment({})}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
