"""Per-phase times of the low-latency EP kernels, from the records their diagnosis build writes.

The build (manifests/kernels/ep_moe.cu compiled with -DLL_PHASES=1: kernels ep_dispatch_ll_phases and
ep_combine_ll_phases of manifests/ep_moe.json) writes, per launch and block, one record of WORDS u64 into
the buffer ll_phases [launches][2][blocks][WORDS] (kernel 0 dispatch, 1 combine; a launch of epoch e in slot
e % launches):

    words 0 .. STAMPS-1            %globaltimer (ns) at each phase boundary (one clock for the whole GPU)
    words STAMPS .. 2 STAMPS-1     clock64() (SM cycles) at the same boundaries (one counter per SM)
    word 14, 15                    the SM id, the launch's epoch

Which to trust for what: a block's phase durations come from its cycle deltas (exact within one SM),
converted to µs with the SM clock measured in the same run (`sm_clock_ghz`, from ep_ll_clock's spin);
figures that compare blocks (the kernel's span: the last block at a boundary minus the first block's entry)
come from globaltimer, whose update granularity is coarse on some GPUs (up to 1 µs): good to about that.
Pure numpy: the rank program reads the buffers, this module checks and summarizes them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

STAMPS = 7  # NOTE: ep_moe.cu's LL_STAMPS
WORDS = 16  # NOTE: ep_moe.cu's LL_PHASE_WORDS
SMID_WORD, EPOCH_WORD = 2 * STAMPS, 2 * STAMPS + 1
KERNELS = ("dispatch", "combine")
# the boundaries each kernel stamps, in order (ep_moe.cu, LL_PHASES); phase k runs from boundary k-1 to k.
# "announced" is block 0's store of the epoch into every member's flag (other blocks have nothing to do there)
BOUNDARIES = {
    "dispatch": ("entry", "sent", "barrier", "announced", "waited", "layout"),
    "combine": ("entry", "sent", "barrier", "announced", "waited", "reduced"),
}
# NOTE: launches kept per kernel: the Sampler's most bodies per graph (tray.bench.timing.MAX_REPS_PER_GRAPH),
# so one replay of the timed graph fills every slot with launches timed back to back
LAUNCH_SLOTS = 64
# NOTE: blocks recorded per launch: above any GPU's SM count today (H200 132, B200 148); the grid is at most
# the SM count (one block per SM: the grid barrier needs them co-resident)
BLOCK_SLOTS = 256


@dataclass(frozen=True)
class KernelRecords:
    """The valid launches of one kernel: `records` u64 [launches, blocks, WORDS] in epoch order, and what was
    wrong with the rest (`problems`, empty when every record is sane)."""

    records: np.ndarray
    problems: list[str] = field(default_factory=list)


def sm_clock_ghz(clock: np.ndarray) -> float:
    """The SM clock in GHz (cycles per ns) from ep_ll_clock's u64[4] = {ns0, cycles0, ns1, cycles1}. Raises
    ValueError when the spin measured no time or no cycles (the kernel did not run)."""
    ns0, c0, ns1, c1 = (int(w) for w in clock[:4])
    if ns1 <= ns0 or c1 <= c0:
        raise ValueError(f"ll_clock holds {[ns0, c0, ns1, c1]}: no time or no cycles between its ends (expected "
                         "ep_ll_clock's spin: ns1 > ns0 and cycles1 > cycles0); was the ll_clock program run?")
    return (c1 - c0) / (ns1 - ns0)


def kernel_records(phases: np.ndarray, kernel: str, grid: int, last_epoch: int) -> KernelRecords:
    """The records of `kernel` ("dispatch" or "combine") from the ll_phases buffer `phases` (u64
    [slots, 2, block_slots, WORDS]) for a grid of `grid` blocks whose last launch had epoch `last_epoch`: the
    slots holding one of the last `slots` epochs (older slots were never written in this run, or overwritten),
    each checked: every block carries the slot's epoch, stamps non-zero and non-decreasing in both clocks.
    Launches with a bad block are left out and named in `problems`. Raises ValueError for a grid the buffer
    cannot hold or an unknown kernel."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel is one of {KERNELS}, got {kernel!r}")
    slots, _, block_slots, words = phases.shape
    if words != WORDS or not 1 <= grid <= block_slots:
        raise ValueError(f"ll_phases {list(phases.shape)} holds {block_slots} blocks of {WORDS} words; got a grid of "
                         f"{grid} blocks and {words} words (raise ll_phase_blocks to at least the grid)")
    n = len(BOUNDARIES[kernel])
    recs = phases[:, KERNELS.index(kernel), :grid, :]
    problems: list[str] = []
    good = []
    for epoch in range(max(1, last_epoch - slots + 1), last_epoch + 1):
        r = recs[epoch % slots]
        epochs = r[:, EPOCH_WORD].astype(np.int64)
        if not (epochs == epoch).any():
            continue  # NOTE: a slot no launch of this window wrote (fewer launches than slots)
        ns = r[:, :n].astype(np.int64)
        cyc = r[:, STAMPS : STAMPS + n].astype(np.int64)
        bad = []
        if (epochs != epoch).any():
            bad.append(f"blocks {np.flatnonzero(epochs != epoch)[:8].tolist()} hold another epoch")
        if (ns == 0).any() or (cyc == 0).any():
            bad.append("a stamp is 0 (a boundary not recorded)")
        down = (np.diff(ns, axis=1) < 0).any(axis=1) | (np.diff(cyc, axis=1) < 0).any(axis=1)
        if down.any():
            bad.append(f"stamps decrease in blocks {np.flatnonzero(down)[:8].tolist()}")
        if bad:
            problems.append(f"{kernel} launch of epoch {epoch}: " + "; ".join(bad))
        else:
            good.append(r)
    if not good:
        problems.append(f"{kernel}: no launch of epochs {max(1, last_epoch - slots + 1)}..{last_epoch} recorded "
                        f"whole ({grid} blocks)")
    return KernelRecords(np.stack(good) if good else np.zeros((0, grid, WORDS), np.uint64), problems)


def _median(values: np.ndarray) -> float:
    return float(statistics.median(values.ravel().tolist())) if values.size else float("nan")


def summarize(kernel: str, records: np.ndarray, clock_ghz: float) -> dict[str, Any]:
    """Per-phase figures of `kernel` from its valid `records` (u64 [launches, blocks, WORDS], kernel_records'):

    since_entry_us  per boundary: median over launches of (the last block's stamp there - the first block's
                    entry), globaltimer: the kernel's timeline as a whole
    phase_us        per phase (the boundary it ends at): from each block's clock64 delta / clock_ghz:
                    "median" over every (launch, block), "max_block" the median over launches of the slowest
                    block, "block0" block 0's median (the announcing block)
    phase_us_globaltimer  the per-block deltas from globaltimer, median over every (launch, block): a
                    cross-check of phase_us, coarse where the timer is
    entry_spread_us median over launches of (last block's entry - first block's entry)
    Raises ValueError for a clock that is not positive."""
    if not clock_ghz > 0:
        raise ValueError(f"the SM clock must be positive GHz, got {clock_ghz}")
    names = BOUNDARIES[kernel]
    n = len(names)
    ns = records[..., :n].astype(np.int64)
    cyc = records[..., STAMPS : STAMPS + n].astype(np.int64)
    first_entry = ns[:, :, 0].min(axis=1)
    since = {names[k]: _median((ns[:, :, k].max(axis=1) - first_entry) / 1e3) for k in range(1, n)}
    cycles_us = np.diff(cyc, axis=2) / (clock_ghz * 1e3)
    timer_us = np.diff(ns, axis=2) / 1e3
    phase = {
        names[k]: {
            "median": _median(cycles_us[:, :, k - 1]),
            "max_block": _median(cycles_us[:, :, k - 1].max(axis=1)),
            "block0": _median(cycles_us[:, 0, k - 1]),
        }
        for k in range(1, n)
    }
    return {
        "launches": int(records.shape[0]),
        "blocks": int(records.shape[1]),
        "boundaries": list(names),
        "since_entry_us": since,
        "phase_us": phase,
        "phase_us_globaltimer": {names[k]: _median(timer_us[:, :, k - 1]) for k in range(1, n)},
        "entry_spread_us": _median((ns[:, :, 0].max(axis=1) - first_entry) / 1e3),
        "sms": int(np.unique(records[..., SMID_WORD]).size),
    }


def table(entry: dict[str, Any], indent: str = "    ") -> list[str]:
    """Printable lines of one rank's ll_phases entry (the rank program's): per kernel, per phase, the span
    since the first block's entry and the per-block durations."""
    clock = entry["clock"]
    driver = clock.get("driver_ghz")
    lines = [f"{indent}SM clock {clock['sm_ghz']:.3f} GHz measured over {clock['spin_ns'] / 1e6:.1f} ms (driver "
             f"attribute {'none' if driver is None else f'{driver:.3f} GHz'}); µs, median over launches"]
    for kernel in KERNELS:
        s = entry[kernel]
        lines.append(
            f"{indent}{kernel}: diagnosis build {entry['us_phases_build'][kernel]:.1f} µs per launch "
            f"(production {entry['us_production'][kernel]:.1f}); {s['launches']} launches x {s['blocks']} blocks; "
            f"entries spread over {s['entry_spread_us']:.2f}"
        )
        lines.append(f"{indent}  {'phase ends at':<14} {'since entry':>11} {'median blk':>10} {'max blk':>9} "
                     f"{'block 0':>9} {'gtimer med':>10}")
        for name in s["boundaries"][1:]:
            p = s["phase_us"][name]
            lines.append(f"{indent}  {name:<14} {s['since_entry_us'][name]:>11.2f} {p['median']:>10.2f} "
                         f"{p['max_block']:>9.2f} {p['block0']:>9.2f} {s['phase_us_globaltimer'][name]:>10.2f}")
    for problem in entry.get("problems", []):
        lines.append(f"{indent}PROBLEM: {problem}")
    return lines
