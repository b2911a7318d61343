"""What the collectives' address arguments cost on the eager path (tray/backend/base.py: every implementation's
address arguments are wrapped so that a view, an array, a tensor or a numpy integer may stand for an address).

A Collectives subclass whose allreduce does nothing is timed with `timeit` (best of `--repeats` runs of `--number`
calls): its wrapped allreduce given ints, the same method unwrapped (`__wrapped__`: what the call cost before), and
the wrapped one given a numpy integer (the conversion's path). Host-only: no GPU, no tray is started. Writes JSON
(with the environment).

    python bench/address_cost.py [--number 200000] [--repeats 5] [--json bench/results/host/address_cost.json]
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np

from tray.backend.base import Collectives
from tray.bench import write_report


class _Nothing(Collectives):
    def allreduce(self, send_ptr, recv_ptr, count, dtype, stream=None):  # type: ignore[no-untyped-def]
        return None

    def allgather(self, send_ptr, recv_ptr, count, dtype, stream=None):  # type: ignore[no-untyped-def]
        return None

    def reducescatter(self, send_ptr, recv_ptr, count, dtype, stream=None):  # type: ignore[no-untyped-def]
        return None

    def alltoall(self, send_ptr, recv_ptr, count, dtype, stream=None):  # type: ignore[no-untyped-def]
        return None

    def sendrecv(self, send_ptr, recv_ptr, count, dtype, peer_index, stream=None):  # type: ignore[no-untyped-def]
        return None

    def close(self) -> None:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--number", type=int, default=200_000, help="calls per timed run")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs; the best is kept")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args()
    c = _Nothing()
    raw = type(c).allreduce.__wrapped__  # type: ignore[attr-defined]
    big = np.int64(1 << 40)
    cases = {
        "wrapped_ints": lambda: c.allreduce(1 << 40, 1 << 41, 8, "f32"),
        "unwrapped_ints": lambda: raw(c, 1 << 40, 1 << 41, 8, "f32"),
        "wrapped_numpy_int": lambda: c.allreduce(big, big, 8, "f32"),
    }
    ns = {name: min(timeit.repeat(fn, number=args.number, repeat=args.repeats)) / args.number * 1e9
          for name, fn in cases.items()}
    report = {"bench": "address-cost", "number": args.number, "repeats": args.repeats,
              "ns_per_call": {k: round(v, 1) for k, v in ns.items()},
              "added_ns_ints": round(ns["wrapped_ints"] - ns["unwrapped_ints"], 1)}
    for name, v in ns.items():
        print(f"address-cost: {name:<18} {v:7.1f} ns per call")
    print(f"address-cost: the wrapper adds {report['added_ns_ints']} ns per call given ints")
    write_report(report, args.json)


if __name__ == "__main__":
    main()
