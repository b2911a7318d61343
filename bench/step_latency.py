"""A tray-wide step's latency on the host backend, next to its transport's floor measured in the same run.

For each rank count N (`--ranks`, each its own launch):
  tray   `tray launch -n N --backend host` of a program whose ranks make `--warmup` exchanges, then `--steps` timed
         ones (`rank.exchange("step", i)`, each timed alone on every rank)
  floor  the same message pattern without tray: N processes, each a pyzmq DEALER, send a message of a Vote's size
         over ipc to one ROUTER (this process), which answers each with one of a Decision's size once it has one
         message from every dealer; each dealer times its round trips (same warm-up and count)
The figure is tray / floor per N (µs per exchange: the median over every rank's steps; p10 and p90 beside it).
`parts` breaks an exchange's time down: what its messages' encoding and checked decoding cost in this process
(one Vote encoded by a rank, N decoded by the head, one Decision encoded and decoded), the sum on a step's critical
path, and that sum's share of the exchange. JSON with the environment.

    python bench/step_latency.py [--ranks 2,4,8] [--steps 3000] [--warmup 300] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path
from typing import Any

import zmq

from tray.bench import median, ratio, stage, write_report
from tray.handshake import wire
from tray.launch.jobdir import scratch_dir

BENCH = "step_latency"
TIMEOUT_S = 600.0
TOPIC = "step"
TOKEN = "0" * 64  # NOTE: the length of a tray's token (32 random bytes, hex), so the floor's messages are as long

RANK_PROGRAM = """
import json, os, sys, time
import tray

out, warmup, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with tray.init() as rank:
    for i in range(warmup):
        rank.exchange("warm", i)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        values = rank.exchange("step", i)
        times.append(time.perf_counter() - t0)
        assert values == [i] * rank.world_size, values
    with open(os.path.join(out, f"tray_{rank.rank}.json"), "w") as f:
        json.dump(times, f)
"""

DEALER_PROGRAM = """
import json, sys, time
import zmq

endpoint, me, out, warmup, steps, nbytes = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.IDENTITY, f"rank-{me}".encode())
sock.setsockopt(zmq.LINGER, 0)
sock.connect(endpoint)
msg = b"v" * nbytes
times = []
for i in range(warmup + steps):
    t0 = time.perf_counter()
    sock.send(msg)
    sock.recv()
    times.append(time.perf_counter() - t0)
with open(f"{out}/floor_{me}.json", "w") as f:
    json.dump(times[warmup:], f)
sock.close()
ctx.term()
"""


def vote_bytes(n: int, rank: int, rnd: int) -> bytes:
    return wire.encode(wire.Vote(token=TOKEN, rank=rank, topic=TOPIC, round=rnd, value=rnd, wait_s=60.0))


def decision_bytes(n: int, rnd: int) -> bytes:
    return wire.encode(wire.Decision(token=TOKEN, topic=TOPIC, round=rnd, values=(rnd,) * n))


def spread(seconds: list[float]) -> dict[str, float]:
    """Median, p10 and p90 of `seconds`, in µs."""
    us = sorted(s * 1e6 for s in seconds)
    deciles = statistics.quantiles(us, n=10)
    return {"median_us": median(us), "p10_us": deciles[0], "p90_us": deciles[-1], "samples": len(us)}


def tray_once(n: int, warmup: int, steps: int, work: Path) -> list[float]:
    prog = work / "step_latency_rank.py"
    prog.write_text(RANK_PROGRAM)
    cmd = [sys.executable, "-m", "tray", "launch", "-n", str(n), "--backend", "host", "-q", "--", sys.executable,
           str(prog), str(work), str(warmup), str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise SystemExit(f"tray launch -n {n} failed (exit {done.returncode}):\n{done.stdout[-2000:]}"
                         f"{done.stderr[-3000:]}")
    return [t for r in range(n) for t in json.loads((work / f"tray_{r}.json").read_text())]


def floor_once(n: int, warmup: int, steps: int, work: Path) -> list[float]:
    """N dealer processes against a ROUTER in this process: each round answered once every dealer sent one."""
    endpoint = f"ipc://{work}/floor.sock"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    reply = decision_bytes(n, 1)
    dealers = [subprocess.Popen([sys.executable, "-c", DEALER_PROGRAM, endpoint, str(r), str(work), str(warmup),
                                 str(steps), str(len(vote_bytes(n, r, 1)))]) for r in range(n)]
    try:
        sock.setsockopt(zmq.RCVTIMEO, int(TIMEOUT_S * 1000))
        for _ in range(warmup + steps):
            idents = [sock.recv_multipart()[0] for _ in range(n)]
            for ident in idents:
                sock.send_multipart([ident, reply])
        for p in dealers:
            if p.wait(timeout=TIMEOUT_S) != 0:
                raise SystemExit(f"a floor dealer exited with code {p.returncode}")
    except zmq.Again:
        raise SystemExit(f"the floor's router heard nothing for {TIMEOUT_S:.0f} s") from None
    finally:
        for p in dealers:
            if p.poll() is None:
                p.kill()
                p.wait()
        sock.close()
        ctx.term()
    return [t for r in range(n) for t in json.loads((work / f"floor_{r}.json").read_text())]


def parts(n: int) -> dict[str, float]:
    """µs each message's encoding and checked decoding take in this process, and their sum on a step's critical path
    (the head decodes the N votes one after the other)."""
    def us(fn: Any, number: int = 2000) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    vote = vote_bytes(n, 0, 1)
    decision = decision_bytes(n, 1)
    got = {
        "vote_encode_us": us(lambda: vote_bytes(n, 0, 1)),
        "vote_decode_us": us(lambda: wire.decode(vote, token=TOKEN, sender="rank-0")),
        "decision_encode_us": us(lambda: decision_bytes(n, 1)),
        "decision_decode_us": us(lambda: wire.decode(decision, token=TOKEN, sender="the head")),
    }
    got["codec_on_path_us"] = (got["vote_encode_us"] + n * got["vote_decode_us"] + got["decision_encode_us"]
                               + got["decision_decode_us"])
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2,4,8", help="rank counts, comma-separated")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1 or args.steps < 10 or args.warmup < 0:
        ap.error(f"--ranks: rank counts >= 1, comma-separated (got {args.ranks!r}); --steps >= 10; --warmup >= 0")
    t_start = time.monotonic()
    report: dict[str, Any] = {"bench": BENCH, "backend": "host", "steps": args.steps, "warmup": args.warmup,
                              "ranks": {}}
    with scratch_dir() as tmp:  # locked under the jobs root: the next tray removes it if this process is killed
        work = Path(tmp)
        for i, n in enumerate(ranks, 1):
            stage(BENCH, i, len(ranks), f"{n} ranks: {args.steps} exchanges, then the floor")
            tray = spread(tray_once(n, args.warmup, args.steps, work))
            floor = spread(floor_once(n, args.warmup, args.steps, work))
            split = parts(n)
            split["codec_share"] = ratio(split["codec_on_path_us"], tray["median_us"])
            report["ranks"][str(n)] = {"tray": tray, "floor": floor,
                                       "ratio": ratio(tray["median_us"], floor["median_us"]), "parts": split}
            print(f"{BENCH}: {n} ranks: exchange median {tray['median_us']:.0f} µs (p10 {tray['p10_us']:.0f}, p90 "
                  f"{tray['p90_us']:.0f}); floor {floor['median_us']:.0f} µs (p10 {floor['p10_us']:.0f}, p90 "
                  f"{floor['p90_us']:.0f}); tray/floor {report['ranks'][str(n)]['ratio']:.2f}; encode+decode on the "
                  f"path {split['codec_on_path_us']:.0f} µs", flush=True)
    write_report(report, args.json)
    print(f"{BENCH}: done in {time.monotonic() - t_start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
