"""The TP bench on real host-backend trays: the peer allreduces (low-latency, one-shot, two-shot) exact and
identical on every rank; the low-latency one names a member that never sends."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import MANIFESTS

# threads=256,512;lines=1,2 (the 2-rank case: in both formats) less the manifest's shape
SHAPES = ["ar_ll[t256,l2]", "ar_ll[t512,l1]", "ar_ll[t512,l2]"]
SHAPES3 = ["ar_ll3[t256,l1]", "ar_ll3[t256,l2]", "ar_ll3[t512,l1]", "ar_ll3[t512,l2]"]  # ar_ll3 is t128,l1


@pytest.mark.parametrize("n, shapes", [(2, "threads=256,512;lines=1,2;formats=ll,ll3"), (4, None)])
def test_tp_bench_checks_pass(tray_env, tmp_path, n, shapes):
    out = tmp_path / "tp.json"
    # the low-latency path is timed up to 1040 B (at every launch shape asked for) and used up to 8 B
    run = tray_env.run([sys.executable, "-m", "tray", "bench", "tp", "-n", str(n), "--backend", "host", "--sizes",
                        "8,1040,4096", "--tokens", "1,3", "--hidden", "64", "--ffn", "128", "--repeats", "2",
                        "--ll-sweep-bytes", "1040", "--ll-max-bytes", "8", "--json", str(out)]
                       + (["--ll-shapes", shapes] if shapes else []))
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    assert report["passed"]
    assert [s["bytes"] for s in report["sizes"]] == [8, 1040, 4096]
    for s in report["sizes"]:  # 8 B: 4 elements, all in the tail; 1040 B: 520 elements over n chunks
        c = s["checks"]
        ll = {k: 0 for k in ["ar_ll", "ar_ll3", *(SHAPES + SHAPES3 if shapes else [])]} if s["bytes"] <= 1040 else {}
        assert c["wrong"] == {**ll, "ar_oneshot": 0, "ar_twoshot": 0, "ar_nccl": 0} and c["peer_identical_on_all_ranks"]
        assert ("ar_ll" in s["us"]) == ("ar_ll3" in s["us"]) == bool(ll) and s["us"]["ar_nccl"] > 0
        if s["bytes"] == 8:  # the faster line format of this run
            assert s["us"]["ar_peer"] == s["us"][s["ar_peer_path"]] == min(s["us"]["ar_ll"], s["us"]["ar_ll3"]) > 0
            assert s["ar_peer_path"] in ("ar_ll", "ar_ll3") and s["ratios"]["ar_ll3_vs_ll"] > 0
        else:
            assert s["us"]["ar_peer"] == min(s["us"]["ar_oneshot"], s["us"]["ar_twoshot"]) > 0
    assert report["ll_max_bytes"] == 8
    if shapes:
        best = report["ll_shapes"]["best_per_size"]
        assert report["ll_shapes"]["default"] == "ar_ll[t256,l1]" and [b["bytes"] for b in best] == [8, 1040]
        assert report["ll_shapes"]["default_ll3"] == "ar_ll3[t128,l1]"
        for b, s in zip(best, report["sizes"]):
            key = {"ar_ll[t256,l1]": "ar_ll", "ar_ll3[t128,l1]": "ar_ll3"}.get(b["best"], b["best"])
            assert b["us"] == s["us"][key] == min(s["us"][k] for k in ["ar_ll", "ar_ll3", *SHAPES, *SHAPES3]), b
    else:
        assert "ll_shapes" not in report
    assert [t["tokens"] for t in report["tokens"]] == [1, 3]
    for t in report["tokens"]:
        c = t["checks"]
        assert c["mlp_peer_vs_one_gpu_rel_err"] < 1e-2 and c["two_shot_equals_one_shot"], c
        assert c["ll_equals_one_shot"] and "mlp_ll" in t["us"], t  # the layer's 128 and 384 B within the sweep
        assert t["us"]["mlp_one_gpu"] > 0


def test_tp_bench_within_each_node_of_a_two_node_job(tray_env, tmp_path):
    """2 nodes x 2 ranks on this machine: every node one TP group of its 2 ranks, every path exact."""
    out = tmp_path / "tp.json"
    run = tray_env.run([sys.executable, "-m", "tray", "bench", "tp", "-n", "4", "--nnodes", "2", "--backend", "host",
                        "--sizes", "8,1040", "--tokens", "3", "--hidden", "64", "--ffn", "128", "--repeats", "1",
                        "--ll-sweep-bytes", "1040", "--ll-max-bytes", "8", "--json", str(out)], timeout_s=120)
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    assert report["passed"] and report["nnodes"] == 2 and report["tp_size"] == 2, report
    assert report["tp_within_nodes"] and report["tp_groups"] == [[0, 1], [2, 3]], report
    assert [s["bytes"] for s in report["sizes"]] == [8, 1040]
    for s in report["sizes"]:
        c = s["checks"]
        assert c["wrong"] == {"ar_ll": 0, "ar_ll3": 0, "ar_oneshot": 0, "ar_twoshot": 0, "ar_nccl": 0}, c
        assert c["peer_identical_on_all_ranks"] and c["passed"], c
    (t,) = report["tokens"]
    assert t["checks"]["passed"] and t["checks"]["mlp_peer_vs_one_gpu_rel_err"] < 1e-2, t
    assert "as a job of 2 nodes of 2 ranks, TP within each node" in run.stdout and "ffn 128 (64 per rank)" in run.stdout
    assert "PASSED" in run.stdout, run.output


def test_tp_refuses_odd_byte_sizes(tray_env):
    run = tray_env.run(
        [sys.executable, "-m", "tray", "bench", "tp", "-n", "2", "--backend", "host", "--sizes", "25"]
    )
    assert run.returncode == 2 and "even byte counts" in run.stderr, run.output


LL_MISSING = """
import tray.programs.tp_mlp.twins  # the host twins of the manifest's kernels, registered before init
from tray.programs.tp_mlp.ll import LLTimeout, check_state
program = sys.argv[2]  # ar_ll or ar_ll3
with tray.init() as rank:
    g = rank.group("node")
    if rank.rank == 0:  # rank 1 never runs it: rank 0's wait for its lines must end, and name rank 1
        rank.run(program, {"count": 8})
        rank.synchronize()
        try:
            check_state([int(w) for w in rank.read("ll_state")], g.name, g.members, g.index, 200_000_000)
        except LLTimeout as exc:
            print(f"named {exc.missing}: {exc}")
        rank.run(program, {"count": 8})  # 2 more launches (it reduces part0, part1): broken, nothing waited for
        rank.synchronize()
        words = [int(w) for w in rank.read("ll_state")]
        print("broken state", words[1:], "launches", words[0] >> 20)
    rank.exchange("done", 0)
"""
LL_MISSING_VARS = ["max_count=64", "count=64", "max_tokens=1", "tokens=1", "hidden=8", "ffn_local=8",
                   "ll_max_count=64", "ll_timeout_ns=200000000"]


@pytest.mark.parametrize("program", ["ar_ll", "ar_ll3"])
def test_ll_allreduce_names_a_member_that_never_sends(tray_env, program):
    run = tray_env.run(tray_env.command(2, LL_MISSING, "--manifest", str(MANIFESTS / "tp_mlp.json"),
                                        *[a for v in LL_MISSING_VARS for a in ("--var", v)]) + [program])
    assert run.returncode == 0, run.output
    assert "named [1]: " in run.stdout and "rank 0 waited 0.20 s for rank 1" in run.stdout, run.output
    assert "broken state [1, 2, 0] launches 4" in run.stdout, run.output


LL_STRESS = """
import tray.programs.tp_mlp.twins  # the host twins of the manifest's kernels, registered before init
from tray.programs.tp_mlp.ll import check_state
K, R, STRESS = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]  # STRESS: ll_stress or ll3_stress
with tray.init() as rank:
    g = rank.group("node")
    v = {"count": rank.resolved.vars["count"]}
    for k in ("tp_ll_stress_step", "tp_ll_stress_next", "tp_ll_allreduce", "tp_ll3_allreduce"):
        rank.kernel(k)  # compiled (cuda) before any rank waits for another in the allreduce
    rank.exchange("compiled", 0)
    rank.run(STRESS, v)  # eagerly once (round 0): plans built outside the capture
    rank.synchronize()
    graph = rank.backend.capture(lambda: [rank.run(STRESS, v) for _ in range(K)])
    try:
        for _ in range(R):  # no host sync between replays: the ranks drift, member r % G held back each round
            graph.replay()
        rank.run("ll_stress_check", v)
        rank.synchronize()
    finally:
        graph.close()
    check_state([int(w) for w in rank.read("ll_state")], g.name, g.members, g.index,
                rank.resolved.vars["ll_timeout_ns"])
    st = rank.read("ll_stress")
    print(f"stress rounds {int(st[0])} wrong {int(st[1])}")
    rank.exchange("done", 0)
"""


def ll_stress_vars(count: int) -> list[str]:
    """Launch arguments of LL_STRESS: buffers for `count` elements, the layer's buffers minimal."""
    small = [f"max_count={max(count, 8)}", f"count={count}", "max_tokens=1", "tokens=1", "hidden=8", "ffn_local=8",
             f"ll_max_count={count}"]
    return [a for v in small for a in ("--var", v)]


@pytest.mark.parametrize("n, stress", [(2, "ll_stress"), (3, "ll_stress"), (3, "ll3_stress")])
def test_ll_allreduce_stress_every_round_right(tray_env, n, stress):
    """Rounds of different inputs through the low-latency slots (either line format), replayed from a graph with
    a skewed member per round: every round's sum checked on every rank (1 eager round + 4 x 5 replayed)."""
    run = tray_env.run(tray_env.command(n, LL_STRESS, "--manifest", str(MANIFESTS / "tp_mlp.json"),
                                        *ll_stress_vars(1040)) + ["4", "5", stress], timeout_s=120)
    assert run.returncode == 0, run.output
    assert run.stdout.count("stress rounds 21 wrong 0") == n, run.output


def test_ll_allreduce_stress_at_another_launch_shape(tray_env):
    """The same stress with the low-latency launch shape set by manifest vars (64 threads, 2 lines each)."""
    shape = ["--var", "ll_threads=64", "--var", "ll_lines=2"]
    run = tray_env.run(tray_env.command(2, LL_STRESS, "--manifest", str(MANIFESTS / "tp_mlp.json"),
                                        *ll_stress_vars(1040), *shape) + ["4", "5", "ll_stress"], timeout_s=120)
    assert run.returncode == 0, run.output
    assert run.stdout.count("stress rounds 21 wrong 0") == 2, run.output
