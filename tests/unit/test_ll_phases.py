"""The low-latency kernels' phase records (tray/programs/ep_moe/ll_phases.py): checked, summarized, printed; and
the bench's --ll-phases switch: refused where it cannot measure, its vars and report entry."""

from __future__ import annotations

import numpy as np
import pytest

from tray.errors import UsageError
from tray.programs.ep_moe import ll_phases as lp
from tray.programs.ep_moe.bench import EpBenchArgs, ll_phase_vars, ll_phases_of, validate

GHZ = 2.0  # 2000 cycles a µs
BLOCKS = 3
N = len(lp.BOUNDARIES["dispatch"])


def launch_records(epoch: int, slow_block: int | None = None) -> np.ndarray:
    """u64 [BLOCKS, WORDS] of one dispatch launch: block b enters at 10 µs + 0.1 b µs and spends 1 µs in each
    phase (2000 cycles; each block its own counter, 10^6 + 50000 b at entry), except `slow_block`, whose last
    phase takes 4 µs."""
    r = np.zeros((BLOCKS, lp.WORDS), np.uint64)
    for b in range(BLOCKS):
        ns = [10_000 + 100 * b + 1000 * k for k in range(N)]
        cyc = [1_000_000 + 50_000 * b + 2000 * k for k in range(N)]
        if b == slow_block:
            ns[-1] += 3000
            cyc[-1] += 6000
        r[b, :N] = ns
        r[b, lp.STAMPS : lp.STAMPS + N] = cyc
        r[b, lp.SMID_WORD] = (3, 7, 9)[b]
        r[b, lp.EPOCH_WORD] = epoch
    return r


def buffer(slots: int = 4, block_slots: int = 4, epochs: tuple[int, ...] = (5, 6)) -> np.ndarray:
    """ll_phases [slots][2][block_slots][WORDS] holding dispatch launches `epochs` (the last with a slow block 1)."""
    ph = np.zeros((slots, 2, block_slots, lp.WORDS), np.uint64)
    for e in epochs:
        ph[e % slots, 0, :BLOCKS] = launch_records(e, slow_block=1 if e == epochs[-1] else None)
    return ph


def test_summary_spans_from_globaltimer_and_durations_from_cycles():
    found = lp.kernel_records(buffer(), "dispatch", BLOCKS, last_epoch=6)
    assert found.problems == [] and found.records[:, 0, lp.EPOCH_WORD].tolist() == [5, 6]
    s = lp.summarize("dispatch", found.records, GHZ)
    assert s["launches"] == 2 and s["blocks"] == BLOCKS and s["sms"] == 3
    # the last block's boundary minus the first block's entry: 0.2 µs of entry spread + 1 µs a phase; the slow
    # launch's layout ends 3 µs later (median of 5.2 and 8.2)
    assert s["since_entry_us"]["sent"] == pytest.approx(1.2) and s["since_entry_us"]["waited"] == pytest.approx(4.2)
    assert s["since_entry_us"]["layout"] == pytest.approx((5.2 + 8.1) / 2)
    assert s["entry_spread_us"] == pytest.approx(0.2)
    assert s["phase_us"]["sent"] == {"median": pytest.approx(1.0), "max_block": pytest.approx(1.0),
                                     "block0": pytest.approx(1.0)}
    # one slow block in one launch of two: the median block does not see it, the slowest block's median does
    assert s["phase_us"]["layout"] == {"median": pytest.approx(1.0), "max_block": pytest.approx(2.5),
                                       "block0": pytest.approx(1.0)}
    assert s["phase_us_globaltimer"]["layout"] == pytest.approx(1.0)
    assert list(s["since_entry_us"]) == list(lp.BOUNDARIES["dispatch"][1:])


def test_records_that_fail_their_checks_are_named_and_left_out():
    ph = buffer()
    ph[6 % 4, 0, 2, lp.EPOCH_WORD] = 2  # block 2 of the launch of epoch 6 holds an older launch's record
    ph[5 % 4, 0, 1, lp.STAMPS + 3] = 1  # block 1's cycle counter runs backwards in epoch 5
    found = lp.kernel_records(ph, "dispatch", BLOCKS, last_epoch=6)
    assert found.records.shape == (0, BLOCKS, lp.WORDS)
    text = " | ".join(found.problems)
    assert "epoch 6: blocks [2] hold another epoch" in text and "epoch 5: stamps decrease in blocks [1]" in text
    assert "no launch of epochs 3..6 recorded whole" in text
    ph = buffer()
    ph[5 % 4, 0, 0, 4] = 0  # a boundary never stamped
    found = lp.kernel_records(ph, "dispatch", BLOCKS, last_epoch=6)
    assert found.records.shape[0] == 1 and "epoch 5: a stamp is 0" in found.problems[0]


def test_slots_of_older_epochs_and_other_kernels_are_not_read():
    ph = buffer(epochs=(1, 2, 3, 4, 5, 6))  # slots 1 and 2 were overwritten by epochs 5 and 6
    found = lp.kernel_records(ph, "dispatch", BLOCKS, last_epoch=6)
    assert found.problems == [] and found.records[:, 0, lp.EPOCH_WORD].tolist() == [3, 4, 5, 6]
    assert lp.kernel_records(ph, "combine", BLOCKS, last_epoch=0).problems == [
        "combine: no launch of epochs 1..0 recorded whole (3 blocks)"]
    with pytest.raises(ValueError, match="raise ll_phase_blocks"):
        lp.kernel_records(ph, "dispatch", 5, last_epoch=6)
    with pytest.raises(ValueError, match="kernel is one of"):
        lp.kernel_records(ph, "layout", BLOCKS, last_epoch=6)


def test_sm_clock_from_the_spin_and_its_refusals():
    assert lp.sm_clock_ghz(np.array([1000, 5000, 1_001_000, 1_985_000], np.uint64)) == pytest.approx(1.98)
    with pytest.raises(ValueError, match="was the ll_clock program run"):
        lp.sm_clock_ghz(np.zeros(4, np.uint64))
    with pytest.raises(ValueError, match="SM clock must be positive"):
        lp.summarize("dispatch", launch_records(1)[None], 0.0)


def test_table_prints_every_phase_and_the_problems():
    s = lp.summarize("dispatch", launch_records(1)[None], GHZ)
    entry = {
        "clock": {"sm_ghz": GHZ, "spin_ns": 1_000_000, "driver_ghz": 1.98},
        "us_phases_build": {"dispatch": 15.0, "combine": 19.0},
        "us_production": {"dispatch": 14.7, "combine": 18.5},
        "dispatch": s,
        "combine": {**s, "boundaries": list(lp.BOUNDARIES["combine"]),
                    **{k: {b2: s[k][b1] for b1, b2 in zip(lp.BOUNDARIES["dispatch"][1:], lp.BOUNDARIES["combine"][1:],
                                                           strict=True)}
                       for k in ("since_entry_us", "phase_us", "phase_us_globaltimer")}},
        "problems": ["combine launch of epoch 3: a stamp is 0 (a boundary not recorded)"],
    }
    text = "\n".join(lp.table(entry))
    assert "dispatch: diagnosis build 15.0 µs per launch (production 14.7)" in text
    for name in (*lp.BOUNDARIES["dispatch"][1:], *lp.BOUNDARIES["combine"][1:]):
        assert f"  {name} " in text
    assert "PROBLEM: combine launch of epoch 3" in text and "SM clock 2.000 GHz" in text
    assert "(driver attribute 1.980 GHz)" in text
    entry["clock"]["driver_ghz"] = None  # the attribute could not be read: the measured clock stands alone
    assert "(driver attribute none)" in "\n".join(lp.table(entry))


def bench_args(**kw) -> EpBenchArgs:
    return EpBenchArgs(**{"nprocs": 2, "backend": "cuda", "experts": 16, "topk": 4, "hidden": 256, "expert_dim": 256,
                          "gemm": "masked", "ll_phases": True, **kw})


@pytest.mark.parametrize("kw, seen", [({"backend": "host"}, "--backend host"), ({"nnodes": 2}, "--nnodes 2"),
                                      ({"gemm": "cublas"}, "--gemm cublas")])
def test_ll_phases_is_refused_where_it_cannot_measure(kw, seen):
    with pytest.raises(UsageError, match=f"--ll-phases .* needs --backend cuda .*{seen}"):
        validate(bench_args(**kw))
    validate(bench_args())
    validate(bench_args(ll_phases=False, **kw))


def test_ll_phase_vars_and_report_entry():
    assert ll_phase_vars(bench_args(ll_phases=False)) == {}
    assert ll_phase_vars(bench_args()) == {"ll_phase_blocks": lp.BLOCK_SLOTS, "ll_phase_launches": lp.LAUNCH_SLOTS}
    runs = [{"runs": [{"label": "a"}]}, {"runs": [{"label": "a"}]}]
    assert ll_phases_of(runs, 0) is None
    runs[0]["runs"][0]["ll_phases"] = {"ok": True}
    runs[1]["runs"][0]["ll_phases"] = {"ok": False}
    assert ll_phases_of(runs, 0) == {"per_rank": [{"ok": True}, {"ok": False}], "ok": False}
    del runs[1]["runs"][0]["ll_phases"]
    assert ll_phases_of(runs, 0)["ok"] is False  # a rank that took none
