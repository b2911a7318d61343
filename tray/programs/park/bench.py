"""Park/wake: GB/s per rank and for the whole tray, next to the pinned-copy ceiling of the same run.

    tray bench park -n 4 [--backend host|cuda] [--gib G] [--page-mib 2] [--repeats 5] [--json PATH] [--plot PNG]
    python bench/park.py -n 4 ...                  (the same, the figure's entry script)

Every rank leases G GiB of pages of manifests/park.json's state and fills them with random bytes. Then:
  ceiling  one plain `backend.copy` of the same bytes, device -> the same pinned host tier and back, on
           the rank's stream, timed by `backend.timer()` (device events on cuda); median of 5.
  park     wall clock around `rank.park` (both votes included); `wake` likewise; median of --repeats.
           Every page is marked written (`session.touch()`, bookkeeping only) before these parks, so
           each copies all G GiB: what is measured is the full copy. After every wake every byte is
           checked against what was written.
  partial  the same lease with one page in PARTIAL_EVERY marked written (scattered): the park copies
           only those; reported with the bytes it moved.
First each rank alone (the others lease an empty session and wait at the votes), then all ranks at
once with a contiguous lease, then all ranks at once with a fragmented lease (no two of its device
pages adjacent: each page is its own copy), against the contiguous round's ceiling. The device pool
holds twice the lease, so the fragmented lease can be made. Targets on 4x H200: park and wake >= 0.9x
the ceiling per GPU and all four at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tray.bench import Row, format_table, plot_lines, require_plot, stage, write_report
from tray.envvars import own_python
from tray.launch.jobdir import scratch_dir
from tray.manifest.builtin import builtin_path
from tray.park.pages import fold_runs

MANIFEST = "park"  # built-in (package data), see tray.manifest.builtin

# NOTE: 0.25 GiB per rank keeps a 4-rank host-backend run (CI, laptops) to a few seconds; on GPUs the
# ceiling needs copies of GiBs to reach the link's steady rate. (`tray bench park --help` quotes both.)
HOST_DEFAULT_GIB = 0.25
CUDA_DEFAULT_GIB = 4.0
TARGET_RATIO = 0.9
CEILING_REPEATS = 5
# NOTE: fill, scribble and check in pieces of at most 64 MiB, so host memory stays small at any G.
CHUNK_NBYTES = 64 << 20
PARTIAL_EVERY = 8  # the partial park marks every 8th page written


# --- on every rank --------------------------------------------------------------------------------------


class Pattern:
    """The bytes a rank writes: page i of a session is a window of one random block, stamped with i."""

    def __init__(self, seed: int, page_nbytes: int, nbytes: int) -> None:
        self.seed = seed
        self.page = page_nbytes
        windows = max(1, min(CHUNK_NBYTES, nbytes) // page_nbytes)
        rng = np.random.default_rng(seed)
        self.base = np.frombuffer(rng.bytes(windows * page_nbytes), np.uint8)
        self.windows = windows

    def pages(self, first: int, count: int) -> np.ndarray:
        """The expected bytes of session pages first..first+count-1, contiguous (u8[count * page])."""
        out = np.empty(count * self.page, np.uint8)
        for j in range(count):
            i, w = first + j, (first + j) % self.windows
            dst = out[j * self.page : (j + 1) * self.page]
            dst[:] = self.base[w * self.page : (w + 1) * self.page]
            if self.page >= 8:
                dst[:8] = np.array([(i << 20) ^ self.seed], np.uint64).view(np.uint8)
        return out


def _chunks(session: Any) -> list[tuple[int, int]]:
    """(first session page, page count) of pieces that are contiguous on the device and <= CHUNK_NBYTES."""
    per = max(1, CHUNK_NBYTES // session.page_nbytes)
    out = []
    for run in fold_runs(session.pages, range(session.npages)):
        for off in range(0, run.npages, per):
            out.append((run.dst + off, min(per, run.npages - off)))
    return out


def fill(backend: Any, session: Any, pattern: Pattern) -> None:
    """Write `pattern` into every page of `session`, a device-contiguous piece at a time."""
    for first, count in _chunks(session):
        backend.write(session.ptr(first), pattern.pages(first, count))


def check(backend: Any, session: Any, pattern: Pattern, rank: int) -> int:
    """Bytes of `session` read back and found equal to `pattern`; AssertionError naming the first that differs."""
    checked = 0
    for first, count in _chunks(session):
        got = backend.read(session.ptr(first), count * session.page_nbytes)
        want = pattern.pages(first, count)
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0])
            raise AssertionError(
                f"rank {rank}: after wake, byte {bad} of page {first + bad // session.page_nbytes}"
                f" differs: got {got[bad]}, want {want[bad]}"
            )
        checked += got.nbytes
    return checked


def scribble(backend: Any, pool: Any) -> None:
    """Garbage over the whole device pool, so a wake that copied nothing could not pass the check."""
    garbage = np.full(min(CHUNK_NBYTES, pool.device_nbytes), 0xA5, np.uint8)
    for off in range(0, pool.device_nbytes, garbage.nbytes):
        n = min(garbage.nbytes, pool.device_nbytes - off)
        backend.write(pool.device.ptr + off, garbage[:n])


def _timed_copy(backend: Any, dst: int, src: int, nbytes: int) -> float:
    timer = backend.timer()
    timer.start()
    backend.copy(dst, src, nbytes)
    timer.stop()
    return timer.elapsed_s()


def _fragmented_lease(rank: Any, npages: int) -> Any:
    """A lease of `npages` whose device pages are pairwise non-adjacent: take 2 * npages single pages,
    give back every other one, lease into the holes, then give back the rest. Every rank must call it
    with the same npages (session ids stay aligned)."""
    singles = [rank.lease(1) for _ in range(2 * npages)]
    for s in singles[1::2]:
        s.release()
    session = rank.lease(npages)
    for s in singles[0::2]:
        s.release()
    return session


def _round(rank: Any, npages: int, pattern: Pattern, repeats: int, ceiling_repeats: int,
           fragmented: bool = False) -> dict[str, Any]:
    """One measurement round: every rank takes part in every vote; ranks with npages 0 only wait."""
    backend = rank.backend
    session = _fragmented_lease(rank, npages) if fragmented else rank.lease(npages)
    pool = session.parking.pool(session.state)
    nbytes = session.nbytes
    runs = len(fold_runs(session.pages, range(npages)))
    fill(backend, session, pattern)
    # NOTE: the ceiling copies the session's own pages into the (still unreserved) host tier: same
    # source, same pinned destination, one copy. A fresh pool leases pages 0..n-1, so they are contiguous.
    assert fragmented or runs <= 1, "ceiling needs contiguous pages"
    d2h: list[float] = []
    h2d: list[float] = []
    for k in range(0 if fragmented else ceiling_repeats):
        rank.exchange("bench.ceiling", k)
        if npages:
            dev, host = session.ptr(0), pool.host_ptr(0)
            d2h.append(_timed_copy(backend, host, dev, nbytes))
            h2d.append(_timed_copy(backend, dev, host, nbytes))
    park_s: list[float] = []
    wake_s: list[float] = []
    checked = 0
    for k in range(repeats):
        session.touch()  # every park moves the whole lease
        rank.exchange("bench.park", k)
        t0 = time.perf_counter()
        parked = rank.park(session)
        park_s.append(time.perf_counter() - t0)
        scribble(backend, pool)
        rank.exchange("bench.wake", k)
        t0 = time.perf_counter()
        session = rank.wake(parked)
        wake_s.append(time.perf_counter() - t0)
        checked += check(backend, session, pattern, rank.rank)
    # partial: a scattered eighth of the pages marked written; the park moves only those
    partial_pages = list(range(0, npages, PARTIAL_EVERY))
    stats = session.parking.stats
    partial_s: list[float] = []
    partial_nbytes = 0
    for k in range(repeats):
        session.mark_clean()
        session.touch(partial_pages)
        rank.exchange("bench.partial", k)
        before = stats.bytes_parked
        t0 = time.perf_counter()
        parked = rank.park(session)
        partial_s.append(time.perf_counter() - t0)
        partial_nbytes = stats.bytes_parked - before
        session = rank.wake(parked)
        checked += check(backend, session, pattern, rank.rank)
    session.release()
    if not npages:
        return {}
    row = {
        "rank": rank.rank,
        "nbytes": nbytes,
        "device_runs": runs,
        "checked_bytes": checked,
        "park_s": statistics.median(park_s),
        "wake_s": statistics.median(wake_s),
        "partial_park_s": statistics.median(partial_s),
        "partial_park_nbytes": partial_nbytes,
        "d2h_ceiling_s": statistics.median(d2h) if d2h else float("nan"),
        "h2d_ceiling_s": statistics.median(h2d) if h2d else float("nan"),
        "park_runs_s": park_s,
        "wake_runs_s": wake_s,
        "partial_park_runs_s": partial_s,
        "d2h_runs_s": d2h,
        "h2d_runs_s": h2d,
    }
    return _rates(row)


def _rates(row: dict[str, Any]) -> dict[str, Any]:
    gb = row["nbytes"] / 1e9
    for key in ("park", "wake", "d2h_ceiling", "h2d_ceiling"):
        row[f"{key}_gbps"] = gb / row[f"{key}_s"] if row[f"{key}_s"] > 0 else float("inf")
    moved = row["partial_park_nbytes"] / 1e9
    row["partial_park_gbps"] = moved / row["partial_park_s"] if row["partial_park_s"] > 0 else float("inf")
    row["park_ratio"] = row["park_gbps"] / row["d2h_ceiling_gbps"]
    row["wake_ratio"] = row["wake_gbps"] / row["h2d_ceiling_gbps"]
    return row


def with_ceiling(row: dict[str, Any], ceiling: dict[str, Any]) -> dict[str, Any]:
    """`row` (a fragmented round: no ceiling of its own) against the contiguous round's ceiling."""
    out = dict(row)
    for key in ("d2h_ceiling", "h2d_ceiling"):
        out[f"{key}_s"] = ceiling[f"{key}_s"] * row["nbytes"] / ceiling["nbytes"]
    return _rates(out)


def rank_program(out_dir: str, repeats: int, ceiling_repeats: int) -> None:
    import tray

    with tray.init() as rank:
        state = rank.resolved.states[0]
        probe = rank.lease(0)  # every rank leases it: session ids stay aligned
        parking = probe.parking
        probe.release()
        pattern = Pattern(1000 + rank.rank, state.page_nbytes, state.nbytes)
        out: dict[str, Any] = {"rank": rank.rank, "device": rank.backend.info.name}
        t0 = time.perf_counter()
        rounds = rank.world_size + 2
        for turn in range(rank.world_size):
            row = _round(rank, state.pages // 2 if turn == rank.rank else 0, pattern, repeats, ceiling_repeats)
            if turn == rank.rank:
                out["alone"] = row
            if rank.rank == 0:  # the progress line (the bench shows rank 0's output)
                print(f"park: round {turn + 1} of {rounds}: rank {turn} alone ({time.perf_counter() - t0:.1f} s)",
                      flush=True)
        lease = state.pages // 2  # the pool holds two leases: room to fragment one
        out["together"] = _round(rank, lease, pattern, repeats, ceiling_repeats)
        if rank.rank == 0:
            print(f"park: round {rounds - 1} of {rounds}: all ranks at once ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
        out["fragmented"] = _round(rank, lease, pattern, repeats, ceiling_repeats, fragmented=True)
        if rank.rank == 0:
            print(f"park: round {rounds} of {rounds}: all ranks at once, fragmented lease "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
        out["host_pool_placement"] = parking.placement.describe()
        out["copies"] = parking.stats.copies
        Path(out_dir, f"rank-{rank.rank}.json").write_text(json.dumps(out))


# --- the head side ----------------------------------------------------------------------------------------


def _together(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Tray figures: all bytes over the slowest rank's time, for park, wake and both ceilings."""
    total = sum(r["nbytes"] for r in rows)
    out: dict[str, Any] = {"per_rank": rows, "nbytes": total}
    for key in ("park", "wake", "d2h_ceiling", "h2d_ceiling"):
        slowest = max(r[f"{key}_s"] for r in rows)
        out[f"{key}_s"] = slowest
        out[f"{key}_gbps"] = total / 1e9 / slowest if slowest > 0 else float("inf")
    slowest = max(r["partial_park_s"] for r in rows)
    out["partial_park_nbytes"] = sum(r["partial_park_nbytes"] for r in rows)
    out["partial_park_gbps"] = out["partial_park_nbytes"] / 1e9 / slowest if slowest > 0 else float("inf")
    out["park_ratio"] = out["park_gbps"] / out["d2h_ceiling_gbps"]
    out["wake_ratio"] = out["wake_gbps"] / out["h2d_ceiling_gbps"]
    return out


def run(
    nprocs: int,
    backend: str,
    gib: float | None = None,
    page_mib: float = 2.0,
    repeats: int = 5,
    json_path: str | None = None,
    ceiling_repeats: int = CEILING_REPEATS,
    plot_path: str | None = None,
) -> int:
    """Run the bench on `nprocs` ranks; print the table, write the JSON report (and the plot). Returns an
    exit code."""
    from tray.launch import TraySpec, run_tray

    require_plot(plot_path)
    if gib is None:
        gib = CUDA_DEFAULT_GIB if backend == "cuda" else HOST_DEFAULT_GIB
        if backend == "host":
            print(f"park: host backend default: {gib} GiB per rank (--gib to change)", flush=True)
    page_nbytes = int(page_mib * (1 << 20))
    pages = max(1, round(gib * (1 << 30) / page_nbytes))
    stage("park", 1, 1, f"{nprocs} ranks, leases of {pages * page_nbytes / (1 << 30):.3g} GiB (a device pool of "
                        f"twice that, a host tier of once) per rank, {nprocs + 2} rounds of {repeats} parks and wakes "
                        "(a line per round from rank 0)")
    with scratch_dir() as scratch:
        tmp = str(scratch)
        python, path = own_python()
        cmd = (
            *python,
            "-m",
            "tray.programs.park.bench",
            "--rank-program",
            tmp,
            "--repeats",
            str(repeats),
            "--ceiling-repeats",
            str(ceiling_repeats),
        )
        spec = TraySpec(
            nprocs=nprocs,
            cmd=cmd,
            backend=backend,
            manifest=str(builtin_path(MANIFEST)),
            timeline=False,
            local_ranks_filter=(0,),
            vars=(("page_nbytes", page_nbytes), ("pages", 2 * pages), ("host_pages", pages)),
            extra_env=(("PYTHONPATH", path),),
        )
        t0 = time.perf_counter()
        result = run_tray(spec)
        wall_s = time.perf_counter() - t0
        if result.exit_code != 0:
            cause = result.root_cause.summary if result.root_cause else "unknown"
            print(f"park bench: the tray failed: {cause}", file=sys.stderr)
            return result.exit_code
        ranks = [json.loads(Path(tmp, f"rank-{r}.json").read_text()) for r in range(nprocs)]
    alone = [r["alone"] for r in ranks]
    together = _together([r["together"] for r in ranks])
    fragmented = _together([with_ceiling(r["fragmented"], r["together"]) for r in ranks])
    report = {
        "bench": "park",
        "nprocs": nprocs,
        "backend": backend,
        "gib_per_rank": pages * page_nbytes / (1 << 30),
        "page_nbytes": page_nbytes,
        "pages_per_rank": pages,
        "repeats": repeats,
        "ceiling_repeats": ceiling_repeats,
        "target_ratio": TARGET_RATIO,
        "alone": alone,
        "together": together,
        "fragmented": fragmented,
        "checked_bytes": sum(r["checked_bytes"] for r in alone + together["per_rank"] + fragmented["per_rank"]),
        "host_pool_placement": [r["host_pool_placement"] for r in ranks],
        "wall_s": wall_s,
    }
    _print(report)
    write_report(report, json_path)
    if plot_path:
        plot(report, plot_path)
        print(f"park: plot in {plot_path}")
    return 0


def rows(report: dict[str, Any]) -> list[Row]:
    """The figures as nccl-tests rows: bytes moved per rank (the tray's: all ranks') in u8, the median time,
    GB/s; #wrong: bytes that differed after a wake (0: a difference fails the rank)."""
    out = []
    n = report["nprocs"]
    for label, r, ranks in ([(f"r{r['rank']} alone", r, 1) for r in report["alone"]]
                            + [("tray, all at once", report["together"], n)]):
        for key, what in (("park", "park"), ("d2h_ceiling", "d2h copy"), ("wake", "wake"),
                          ("h2d_ceiling", "h2d copy")):
            out.append(Row(f"{what} {label}", r["nbytes"], r["nbytes"], "u8", r[f"{key}_s"] * 1e6, 0, "", ranks))
    return out


def plot(report: dict[str, Any], path: str) -> None:
    """Scaling vs ranks: tray-wide GB/s of park, wake and both ceilings with one rank moving (the mean of
    the ranks alone) and with every rank at once."""
    n = report["nprocs"]
    series = {}
    for key, label in (("park", "park"), ("wake", "wake"), ("d2h_ceiling", "d2h copy ceiling"),
                       ("h2d_ceiling", "h2d copy ceiling")):
        alone = sum(r[f"{key}_gbps"] for r in report["alone"]) / len(report["alone"])
        series[label] = ([1, n], [alone, report["together"][f"{key}_gbps"]])
    plot_lines(path, series, title=f"park/wake, {report['backend']} backend", xlabel="ranks moving at once",
               ylabel="GB/s, whole tray", log_x=False, log_y=False)


def _line(name: str, r: dict[str, Any]) -> str:
    return (
        f"  {name:<10} park {r['park_gbps']:7.2f} GB/s ({r['park_ratio']:.2f}x of d2h ceiling "
        f"{r['d2h_ceiling_gbps']:7.2f})   wake {r['wake_gbps']:7.2f} GB/s ({r['wake_ratio']:.2f}x of h2d "
        f"ceiling {r['h2d_ceiling_gbps']:7.2f})"
    )


def _print(report: dict[str, Any]) -> None:
    gib = report["gib_per_rank"]
    print(
        f"park/wake, {report['nprocs']} ranks, {report['backend']} backend, {gib:.3g} GiB per rank in "
        f"{report['pages_per_rank']} pages of {report['page_nbytes'] >> 10} KiB; median of {report['repeats']} "
        f"(ceiling: median of {report['ceiling_repeats']}); target >= {report['target_ratio']}x"
    )
    print(" each rank alone:")
    for r in report["alone"]:
        print(_line(f"rank {r['rank']}", r))
    print(" all ranks at once:")
    for r in report["together"]["per_rank"]:
        print(_line(f"rank {r['rank']}", r))
    print(_line("tray", report["together"]))
    print(" all ranks at once, fragmented lease (every device page its own copy; the contiguous ceiling):")
    for r in report["fragmented"]["per_rank"]:
        print(_line(f"rank {r['rank']}", r) + f"  [{r['device_runs']} runs]")
    print(_line("tray", report["fragmented"]))
    for name in ("together", "fragmented"):
        t = report[name]
        print(f" partial park ({name}): 1 page in {PARTIAL_EVERY} written, {t['partial_park_nbytes'] / 1e9:.3f} GB "
              f"moved at {t['partial_park_gbps']:.2f} GB/s")
    print(f" checked {report['checked_bytes'] / 1e9:.3f} GB after wakes, byte for byte")
    print(format_table(rows(report)))


def main(argv: list[str] | None = None) -> int:
    """The rank side: `python -m tray.programs.park.bench --rank-program OUT_DIR ...` inside the tray that
    `run` launches (the bench itself runs as `tray bench park`)."""
    ap = argparse.ArgumentParser(prog="python -m tray.programs.park.bench")
    ap.add_argument("--rank-program", required=True, help="directory for this rank's result")
    ap.add_argument("--repeats", type=int, required=True)
    ap.add_argument("--ceiling-repeats", type=int, required=True)
    args = ap.parse_args(argv)
    rank_program(args.rank_program, args.repeats, args.ceiling_repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
