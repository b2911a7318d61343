"""A bench's job of several nodes on one machine (tray/bench/nodes.py): each node's share of the GPUs and
its command line; the EP and TP benches' --nnodes checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tray.bench.nodes import NodeJob, _node_cmd, _node_env, node_devices
from tray.errors import UsageError


def test_each_node_gets_its_share_of_the_visible_gpus():
    assert node_devices(2, 4, None, 4) == ["0,1", "2,3"]
    assert node_devices(2, 2, "5,7,9", 3) == ["5", "7"]          # the parent's CUDA_VISIBLE_DEVICES, in order
    assert node_devices(2, 4, None, 1, share=True) == ["0", "0"]  # ranks sharing GPUs: every node over all of them
    assert node_devices(2, 4, None, 4, share=True) == ["0,1", "2,3"]  # enough GPUs: a share each, as without
    with pytest.raises(UsageError, match="need 4 GPUs, 2 visible"):
        node_devices(2, 4, None, 2)
    with pytest.raises(UsageError, match="--nnodes 2 must divide -n 3"):
        node_devices(2, 3, None, 4)


def test_node_launch_lines_and_environment():
    job = NodeJob(name="epn", module="m", nnodes=2, nprocs=4, backend="cuda", manifest="ep.json",
                  vars={"tokens": 16, "hidden": 256}, env={"OMP_NUM_THREADS": "1"})
    cmd = _node_cmd(job, 1, 4242, Path("/w/epn.json"))
    assert cmd[cmd.index("--node-rank") + 1] == "1" and cmd[cmd.index("-n") + 1] == "2"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "127.0.0.1:4242"
    assert cmd[-3:] == ["-m", "m", "/w/epn.json"] and "hidden=256" in cmd and "tokens=16" in cmd
    env = _node_env(job, 1, "t" * 64, ["0,1", "2,3"])
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["TRAY_JOB_TOKEN"] == "t" * 64
    assert env["NCCL_HOSTID"] != _node_env(job, 0, "t" * 64, ["0,1", "2,3"])["NCCL_HOSTID"]
    assert env["OMP_NUM_THREADS"] == "1"


def test_ep_bench_nnodes_must_divide_the_ranks():
    from tray.programs.ep_moe.bench import EpBenchArgs, validate

    with pytest.raises(UsageError, match="--nnodes 3 must be at least 1 and divide -n 4"):
        validate(EpBenchArgs(nprocs=4, backend="host", experts=16, topk=4, hidden=256, expert_dim=256, nnodes=3))
    validate(EpBenchArgs(nprocs=4, backend="host", experts=16, topk=4, hidden=256, expert_dim=256, nnodes=2))


def test_tp_bench_nnodes_checks_and_a_tp_group_per_node():
    from tray.programs.tp_mlp.bench import TpBenchArgs, launch_vars, tp_within_nodes, validate

    def args(**kw):
        return TpBenchArgs(**{"nprocs": 4, "backend": "host", "sizes": (8,), "tokens": (1,), "hidden": 64,
                              "ffn": 128, **kw})

    with pytest.raises(UsageError, match="--nnodes 3 must be at least 1 and divide -n 4"):
        validate(args(nnodes=3))
    with pytest.raises(UsageError, match="-n / --nnodes must be at least 2, got -n 4 over 4 node"):
        validate(args(nnodes=4))
    with pytest.raises(UsageError, match="2 shards \\(the ranks of a node\\)"):
        validate(args(nnodes=2, ffn=24))  # 24 splits into 2 shards of 12: not a multiple of 8
    validate(args(nnodes=2, ffn=16))  # 4 shards of 4 would fail on one node; 2 of 8 is whole vectors
    a = args(nnodes=2)
    assert a.tp_size == 2 and launch_vars(a, a.tp_size)["ffn_local"] == 64  # ffn split over a node's ranks
    group = [{"rank": r, "tp_group": [r // 2 * 2, r // 2 * 2 + 1]} for r in range(4)]
    assert tp_within_nodes(group, 2)
    assert not tp_within_nodes(group, 4)  # the whole job as one group was not asked for
    assert not tp_within_nodes([{**g, "tp_group": [0, 1, 2, 3]} for g in group], 2)  # TP spanning the nodes
    assert not tp_within_nodes(group[:3], 2)  # a rank that never reported
