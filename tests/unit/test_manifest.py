"""Unit tests of tray.manifest: loading, validation errors with JSON paths, resolve, digest, inspect."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tray.errors import ManifestError, UsageError
from tray.manifest import (
    DTYPE_ITEMSIZE,
    BarrierSpec,
    BufferRef,
    CollectiveSpec,
    GemmSpec,
    LaunchSpec,
    ResolvedArg,
    ResolvedBarrier,
    ResolvedCollective,
    ResolvedCopy,
    ResolvedLaunch,
    builtin_manifest,
    format_inspect,
    human_bytes,
    load_manifest,
    parse_manifest,
)

REPO = Path(__file__).resolve().parents[2]


def full_doc() -> dict[str, Any]:
    """A manifest that uses every section and op type; valid at world sizes 4 and 8."""
    return {
        "format": 1,
        "name": "ep_moe",
        "description": "every feature once",
        "vars": {"tokens": 128, "hidden": 7168, "experts": 8},
        "groups": [{"name": "tp", "size": 2}, {"name": "pairs", "ranks": [[0, 1], [2, 3]]}],
        "buffers": [
            {"name": "x", "dtype": "bf16", "shape": ["tokens", "hidden"], "export": True},
            {"name": "y", "dtype": "bf16", "shape": ["tokens * world_size", "hidden"], "group": "tp"},
            {"name": "w", "dtype": "bf16", "shape": ["experts // world_size", 64, 64]},
            {"name": "flag", "dtype": "u64", "shape": [], "export": True,
             "bind": {"file": "ckpt/flag.safetensors", "tensors": ["flag.{rank}"]}},
        ],
        "states": [{"name": "kv", "page_nbytes": 65536, "pages": "16 * world_size"}],
        "kernels": [
            {"name": "dispatch", "source": "kernels/dispatch.cu", "options": ["-O3"], "peers": True},
            {"name": "combine", "source": "kernels/combine.cu", "entry": "tray_combine"},
        ],
        "programs": [
            {
                "name": "step",
                "graph": True,
                "ops": [
                    {
                        "op": "launch",
                        "kernel": "dispatch",
                        "grid": "tokens",
                        "block": [128, 2],
                        "shmem": 1024,
                        "args": ["x", "x@hidden*2", "peers:x", "tokens", "world_size", 3, 0.5],
                    },
                    {
                        "op": "nccl",
                        "collective": "allgather",
                        "group": "tp",
                        "send": "x",
                        "recv": "y",
                        "count": "tokens*hidden",
                        "dtype": "bf16",
                    },
                    {"op": "gemm", "a": "x", "b": "x", "c": "w", "m": 8, "n": 8, "k": 8, "dtype": "bf16"},
                    {"op": "barrier", "group": "pairs"},
                    {"op": "copy", "src": "x@16", "dst": "y", "bytes": 1024},
                    {
                        "op": "nccl",
                        "collective": "sendrecv",
                        "group": "tp",
                        "send": "x",
                        "recv": "x",
                        "count": 4,
                        "dtype": "bf16",
                        "peer": 1,
                    },
                ],
            },
            {"name": "sync", "ops": [{"op": "barrier", "group": "world"}]},
        ],
    }


def scalable_doc() -> dict[str, Any]:
    """A manifest valid at every world size: groups and shapes follow world_size."""
    return {
        "format": 1,
        "name": "scalable",
        "vars": {"tokens": 4, "hidden": 256},
        "groups": [{"name": "node", "size": "world_size"}, {"name": "solo", "size": 1}],
        "buffers": [
            {"name": "x", "dtype": "bf16", "shape": ["tokens", "hidden"], "export": True},
            {"name": "y", "dtype": "f32", "shape": ["tokens * world_size", "hidden"], "group": "node"},
        ],
        "states": [{"name": "kv", "page_nbytes": "hidden * 4", "pages": "8 * world_size"}],
    }


def make_kernels(root: Path) -> None:
    (root / "kernels").mkdir(parents=True, exist_ok=True)
    (root / "kernels" / "dispatch.cu").write_text('extern "C" __global__ void dispatch() {}\n')
    (root / "kernels" / "combine.cu").write_text('extern "C" __global__ void tray_combine() {}\n')


@pytest.fixture
def root(tmp_path: Path) -> Path:
    make_kernels(tmp_path)
    return tmp_path


def write(root: Path, doc: Any, name: str = "m.json") -> str:
    path = root / name
    path.write_text(json.dumps(doc, indent=2))
    return str(path)


def load_error(root: Path, doc: Any) -> tuple[str, ManifestError]:
    path = write(root, doc)
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    return path, info.value


def assert_error(path: str, exc: ManifestError, json_path: str, *fragments: str) -> None:
    assert exc.path == path
    assert exc.json_path == json_path, str(exc)
    assert str(exc).startswith(f"{path}: {json_path}: "), str(exc)
    for fragment in fragments:
        assert fragment in str(exc), str(exc)


# -- loading and resolving -----------------------------------------------------------------------


def test_full_manifest_loads(root: Path) -> None:
    m = load_manifest(write(root, full_doc()))
    assert m.name == "ep_moe" and m.format == 1 and m.description == "every feature once"
    assert m.vars == {"tokens": 128, "hidden": 7168, "experts": 8}
    assert [g.name for g in m.groups] == ["world", "tp", "pairs"]
    assert m.group("pairs").ranks == ((0, 1), (2, 3))
    assert m.group("tp").size == 2
    assert m.buffer("x").shape == ("tokens", "hidden") and m.buffer("x").export
    assert m.buffer("y").group == "tp" and m.buffer("x").group == "world"
    assert m.buffer("flag").shape == ()
    assert m.buffer("flag").bind == {"file": "ckpt/flag.safetensors", "tensors": ["flag.{rank}"]}
    dispatch, combine = m.kernels
    assert dispatch.entry == "dispatch" and dispatch.options == ("-O3",) and dispatch.peers
    assert combine.entry == "tray_combine" and combine.options == () and not combine.peers
    assert os.path.isabs(combine.source) and combine.source == str(root / "kernels" / "combine.cu")
    step = m.program("step")
    assert step.graph and len(step.ops) == 6 and not m.program("sync").graph
    launch = step.ops[0]
    assert isinstance(launch, LaunchSpec) and launch.json_path == "$.programs[0].ops[0]"
    assert launch.grid == ("tokens", 1, 1) and launch.block == (128, 2, 1)
    assert launch.dim_paths[:2] == ("$.programs[0].ops[0].grid", "$.programs[0].ops[0].grid")
    assert launch.dim_paths[3:] == tuple(f"$.programs[0].ops[0].block[{k}]" for k in range(3))
    assert isinstance(step.ops[1], CollectiveSpec) and step.ops[1].peer is None
    assert isinstance(step.ops[2], GemmSpec) and step.ops[2].accumulate is False
    assert combine.code == (root / "kernels" / "combine.cu").read_bytes()
    assert len(m.digest) == 64 and int(m.digest, 16) >= 0
    assert m.doc == full_doc()


@pytest.mark.parametrize("world_size", [4, 8])
def test_full_manifest_resolves(root: Path, world_size: int) -> None:
    r = load_manifest(write(root, full_doc())).resolve(world_size)
    assert r.vars == {"tokens": 128, "hidden": 7168, "experts": 8, "world_size": world_size,
                      "local_world_size": world_size}
    assert r.groups["world"] == (tuple(range(world_size)),)
    assert r.groups["tp"] == tuple((i, i + 1) for i in range(0, world_size, 2))
    assert r.groups["pairs"] == ((0, 1), (2, 3))
    assert r.group_of("tp", 3) == (2, 3)
    assert r.group_of("pairs", world_size - 1) == ((2, 3) if world_size == 4 else None)
    assert r.buffer("y").shape == (128 * world_size, 7168)
    assert r.buffer("y").nbytes == 128 * world_size * 7168 * 2
    assert r.buffer("w").shape == (8 // world_size, 64, 64)
    assert r.buffer("flag").shape == () and r.buffer("flag").nbytes == 8
    assert r.states[0].pages == 16 * world_size and r.states[0].nbytes == 65536 * 16 * world_size
    ops = r.program("step").ops
    assert isinstance(ops[0], ResolvedLaunch) and ops[0].grid == (128, 1, 1)
    assert ops[0].args == (
        ResolvedArg("buffer", name="x"),
        ResolvedArg("buffer", name="x", offset=7168 * 2),
        ResolvedArg("peers", name="x"),
        ResolvedArg("int", name="tokens", value=128),
        ResolvedArg("int", name="world_size", value=world_size),
        ResolvedArg("int", value=3),
        ResolvedArg("float", value=0.5),
    )
    assert isinstance(ops[1], ResolvedCollective) and ops[1].count == 128 * 7168 and ops[1].recv == BufferRef("y")
    assert isinstance(ops[4], ResolvedCopy) and ops[4].src == BufferRef("x", 16) and ops[4].nbytes == 1024
    assert isinstance(ops[5], ResolvedCollective) and ops[5].peer == 1
    assert r.eval("hidden // 2", "$.x") == 3584


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_scalable_manifest_resolves(root: Path, world_size: int) -> None:
    r = load_manifest(write(root, scalable_doc())).resolve(world_size)
    assert r.world_size == world_size
    assert r.groups["node"] == (tuple(range(world_size)),)
    assert r.groups["solo"] == tuple((i,) for i in range(world_size))
    assert r.group_of("solo", world_size - 1) == (world_size - 1,)
    assert [b.shape for b in r.buffers] == [(4, 256), (4 * world_size, 256)]
    assert [b.nbytes for b in r.buffers] == [4 * 256 * 2, 4 * world_size * 256 * 4]
    assert (r.states[0].page_nbytes, r.states[0].pages) == (1024, 8 * world_size)


def node_doc() -> dict[str, Any]:
    """TP within each node: a group of the ranks of each node, its peer buffer, barrier and allreduce."""
    return {
        "format": 1,
        "name": "per_node",
        "vars": {"count": 64},
        "groups": [{"name": "node", "ranks": "node"}],
        "buffers": [
            {"name": "part", "dtype": "bf16", "shape": ["count"], "export": True, "group": "node"},
            {"name": "slots", "dtype": "u32", "shape": ["8 * local_world_size"], "export": True, "group": "node"},
            {"name": "out", "dtype": "bf16", "shape": ["count"]},
        ],
        "programs": [
            {"name": "ar", "ops": [
                {"op": "barrier", "group": "node"},
                {"op": "nccl", "collective": "allreduce", "group": "node", "send": "part", "recv": "out",
                 "count": "count", "dtype": "bf16"},
            ]},
        ],
    }


@pytest.mark.parametrize(("world_size", "local", "instances"), [
    (4, None, ((0, 1, 2, 3),)),  # one node: the same as world
    (4, 4, ((0, 1, 2, 3),)),
    (4, 2, ((0, 1), (2, 3))),
    (6, 3, ((0, 1, 2), (3, 4, 5))),
    (3, 1, ((0,), (1,), (2,))),
])
def test_node_group_resolves_to_the_ranks_of_each_node(root: Path, world_size: int, local: int | None,
                                                      instances: tuple[tuple[int, ...], ...]) -> None:
    m = load_manifest(write(root, node_doc()))
    assert m.group("node").ranks == "node"
    r = m.resolve(world_size, None, local)
    per = local or world_size
    assert r.groups["node"] == instances
    assert r.groups["world"] == (tuple(range(world_size)),)
    assert r.vars["local_world_size"] == per and r.vars["world_size"] == world_size
    assert r.group_of("node", world_size - 1) == instances[-1]
    assert r.buffer("slots").shape == (8 * per,)  # sized by the node's ranks, not the job's
    ar = r.program("ar").ops[1]
    assert isinstance(ar, ResolvedCollective) and ar.group == "node"


def test_node_group_errors(root: Path) -> None:
    m = load_manifest(write(root, node_doc()))
    with pytest.raises(UsageError, match=r"local_world_size \(ranks per node\) must be an int >= 1 that divides "
                                         r"world_size 4, got 3"):
        m.resolve(4, None, 3)
    with pytest.raises(UsageError, match="got -2"):
        m.resolve(4, None, -2)
    with pytest.raises(UsageError, match="'local_world_size' cannot be overridden"):
        m.resolve(4, {"local_world_size": 2})
    # a launch arg and an expression may name it; an unknown name lists it among the known
    doc = node_doc()
    doc["kernels"] = [{"name": "k", "source": "k.cu"}]
    (root / "k.cu").write_text('extern "C" __global__ void k() {}\n')
    doc["programs"][0]["ops"].append({"op": "launch", "kernel": "k", "grid": "local_world_size", "block": 32,
                                      "args": ["local_world_size", "index:node", "world_sz"]})
    with pytest.raises(ManifestError) as info:
        load_manifest(write(root, doc))
    assert_error(str(root / "m.json"), info.value, "$.programs[0].ops[2].args[2]", "local_world_size",
                 "did you mean 'world_size'")
    doc["programs"][0]["ops"][2]["args"][2] = "world_size"
    launch = load_manifest(write(root, doc)).resolve(4, None, 2).program("ar").ops[2]
    assert isinstance(launch, ResolvedLaunch) and launch.grid == (2, 1, 1)
    assert launch.args[:2] == (ResolvedArg("int", name="local_world_size", value=2), ResolvedArg("index", name="node"))


def test_overrides(root: Path) -> None:
    m = load_manifest(write(root, scalable_doc()))
    r = m.resolve(2, {"tokens": 16})
    assert r.vars["tokens"] == 16 and r.buffer("x").shape == (16, 256)
    assert m.vars["tokens"] == 4  # the spec is unchanged
    with pytest.raises(
        UsageError, match=r"unknown var 'tokns'.*known: tokens, hidden.*did you mean 'tokens'"
    ):
        m.resolve(2, {"tokns": 16})
    with pytest.raises(UsageError, match="world_size"):
        m.resolve(2, {"world_size": 4})
    with pytest.raises(UsageError, match="must be an int"):
        m.resolve(2, {"tokens": "16"})  # type: ignore[dict-item]
    # a numpy integer is an int (rank.run(vars={"tokens": counts.max()}), `for t in np.arange(...)`), as peer_view
    # takes one; it was refused ("must be an int ..., got np.int64(16)"); a numpy bool and a float stay refused
    np = pytest.importorskip("numpy")
    assert m.resolve(2, {"tokens": np.int64(16)}).buffer("x").shape == (16, 256)  # type: ignore[dict-item]
    assert type(m.resolve(2, {"tokens": np.uint32(8)}).vars["tokens"]) is int  # type: ignore[dict-item]
    for bad in (np.True_, np.float32(16), True):
        with pytest.raises(UsageError, match="must be an int"):
            m.resolve(2, {"tokens": bad})  # type: ignore[dict-item]
    with pytest.raises(UsageError, match="world_size must be an int >= 1"):
        m.resolve(0)
    with pytest.raises(UsageError, match=r"unknown group 'nod'.*did you mean 'node'"):
        m.resolve(2).group_of("nod", 0)
    with pytest.raises(UsageError, match="unknown program"):
        m.program("step")


def test_a_var_for_the_builtin_default_says_no_manifest_was_given() -> None:
    """`tray launch --var n=8 prog.py` without --manifest: the ranks took the built-in default, and the message said
    "unknown var 'n' for manifest minimal (<builtin>); known: (none)", which names neither cause nor remedy."""
    with pytest.raises(UsageError, match=r"^unknown var 'n': the ranks' manifest is the built-in default \(no "
                                         r"--manifest given, no tray.init\(manifest=...\)\), which declares no vars; "
                                         r"tray launch --manifest FILE.json gives the ranks the manifest that declares "
                                         r"it$"):
        builtin_manifest().resolve(2, {"n": 8})


def test_resolve_errors(root: Path) -> None:
    m = load_manifest(write(root, full_doc()))
    with pytest.raises(ManifestError) as info:
        m.resolve(1)
    assert_error(m.path, info.value, "$.groups[0].size", "world_size 1 is not divisible", "size 2")
    with pytest.raises(ManifestError) as info:
        m.resolve(2)
    assert_error(m.path, info.value, "$.groups[1].ranks[1][0]", "rank 2", "out of range for world_size 2")
    with pytest.raises(ManifestError) as info:
        m.resolve(16)  # experts // world_size == 0
    assert_error(
        m.path, info.value, "$.buffers[2].shape[0]", "must be >= 1, got 0", "experts=8, world_size=16"
    )


@pytest.mark.parametrize(
    ("mutate", "world_size", "json_path", "fragments"),
    [
        (
            lambda d: d["buffers"][0].update(shape=["tokens", "hidden - 7168"]),
            4,
            "$.buffers[0].shape[1]",
            ["must be >= 1, got 0", "hidden=7168"],
        ),
        (
            lambda d: d["buffers"][0].update(shape=["tokens", "hidden // (world_size - 4)"]),
            4,
            "$.buffers[0].shape[1]",
            ["division by zero", "world_size=4"],
        ),
        (lambda d: d["states"][0].update(pages="world_size - 8"), 8, "$.states[0].pages", ["must be >= 1"]),
        (
            lambda d: d["programs"][0]["ops"][4].update(bytes="tokens * hidden * 2"),
            4,
            "$.programs[0].ops[4].src",
            ["copy of 1835008 B needs 1835008 B from offset 16 of buffer 'x'"],
        ),
        (
            lambda d: d["programs"][0]["ops"][1].update(recv="x"),
            4,
            "$.programs[0].ops[1].recv",
            ["allgather", "needs 3670016 B", "buffer 'x', which holds 1835008 B"],
        ),
        (
            lambda d: d["programs"][0]["ops"][0].update(grid="world_size - 4"),
            4,
            "$.programs[0].ops[0].grid",
            ["must be >= 1, got 0 from 'world_size - 4' with world_size=4"],
        ),
        (
            lambda d: d["programs"][0]["ops"][2].update(m=4096),
            4,
            "$.programs[0].ops[2].c",
            ["gemm c (4096 x 8 bf16)"],
        ),
        (  # as a collective's: f32 bytes read as bf16 (cuBLAS on cuda, numpy on host) ran without a word
            lambda d: d["buffers"][2].update(dtype="f32"),
            4,
            "$.programs[0].ops[2].dtype",
            ["gemm of bf16: its c buffer 'w' holds f32", "the op's dtype must be its buffers'"],
        ),
        (
            lambda d: d["programs"][0]["ops"][5].update(peer="world_size"),
            4,
            "$.programs[0].ops[5].peer",
            ["peer 4 is outside group 'tp' of 2 ranks"],
        ),
        (
            lambda d: d["programs"][0]["ops"][0]["args"].__setitem__(1, "x@tokens*hidden*4"),
            4,
            "$.programs[0].ops[0].args[1]",
            ["past the end of buffer 'x'"],
        ),
        (
            lambda d: d["programs"][0]["ops"][0].update(grid=[1, "world_size - 4"]),
            4,
            "$.programs[0].ops[0].grid[1]",
            ["must be >= 1, got 0"],
        ),
        (
            lambda d: d["buffers"][0].update(shape=["tokens * 99999999999", "99999999999"]),
            4,
            "$.buffers[0].shape",
            ["out of range"],
        ),
    ],
)
def test_resolve_error_paths(
    root: Path, mutate: Any, world_size: int, json_path: str, fragments: list[str]
) -> None:
    doc = full_doc()
    mutate(doc)
    m = load_manifest(write(root, doc))
    with pytest.raises(ManifestError) as info:
        m.resolve(world_size)
    assert_error(m.path, info.value, json_path, *fragments)


# -- load-time errors ----------------------------------------------------------------------------


def _set(path: tuple[Any, ...], value: Any) -> Any:
    def mutate(doc: Any) -> None:
        for key in path[:-1]:
            doc = doc[key]
        doc[path[-1]] = value

    return mutate


def _del(*path: Any) -> Any:
    def mutate(doc: Any) -> None:
        for key in path[:-1]:
            doc = doc[key]
        del doc[path[-1]]

    return mutate


OPS = ("programs", 0, "ops")

LOAD_ERRORS = [
    (
        _set(("programz",), []),
        "$.programz",
        ["unknown key 'programz'", "allowed: format, name", "did you mean 'programs'"],
    ),
    (
        _set(("buffers", 0, "grop"), "tp"),
        "$.buffers[0].grop",
        ["allowed: name, dtype, shape", "did you mean 'group'"],
    ),
    (_del("name"), "$", ["missing key 'name'"]),
    (_set(("format",), 2), "$.format", ["unsupported format 2"]),
    (_set(("format",), True), "$.format", ["unsupported format true"]),
    (_set(("format",), 1.0), "$.format", ["unsupported format 1.0"]),  # ints are never floats like 4.0
    # printed by tray inspect as one line: a newline or a terminal's escape went out raw
    (_set(("description",), "two\nlines"), "$.description", ["one line of text", "two\\nlines"]),
    (_set(("description",), "\x1b[2J"), "$.description", ["without control characters"]),
    (_set(("description",), "\x9b2J"), "$.description", ["without control characters"]),  # C1: CSI
    (_set(("name",), "bad name"), "$.name", ["invalid manifest name"]),
    (_set(("vars",), []), "$.vars", ["expected an object"]),
    (_set(("vars", "world_size"), 4), "$.vars.world_size", ["reserved"]),
    (_set(("vars", "local_world_size"), 4), "$.vars.local_world_size", ["reserved", "ranks per node", "rename"]),
    # a var "rank" or "index" was taken, its value used in expressions while launch args and binds said the running rank
    (_set(("vars", "rank"), 3), "$.vars.rank", ["reserved", "running rank", "rename"]),
    (_set(("vars", "index"), 3), "$.vars.index", ["reserved", "index in the buffer's group", "rename"]),
    (_set(("vars", "if"), 4), "$.vars.if", ["invalid var name"]),
    (_set(("vars", "tokens"), "128"), "$.vars.tokens", ['expected an int, got "128"']),
    (_set(("vars", "x"), 1), "$.buffers[0].name", ["buffer 'x' has the name of a var"]),
    # launch args "rank", "world_size" and "local_world_size" pass those values: a buffer of that name could not be
    # passed to a kernel (its address was silently replaced by the number: a twin or kernel writing there crashed)
    (_set(("buffers", 0, "name"), "rank"), "$.buffers[0].name", ["buffer 'rank' has the name of a launch argument"]),
    (_set(("buffers", 0, "name"), "world_size"), "$.buffers[0].name", ["has the name of a launch argument"]),
    (_set(("buffers", 0, "name"), "local_world_size"), "$.buffers[0].name", ["has the name of a launch argument"]),
    (_set(("groups", 0, "ranks"), "all"), "$.groups[0]", ["exactly one of 'ranks' or 'size'"]),
    (_del("groups", 0, "size"), "$.groups[0]", ["exactly one of 'ranks' or 'size'"]),
    (
        _set(("groups", 1, "ranks"), [[0, 1], [1, 2]]),
        "$.groups[1].ranks[1][0]",
        ["rank 1 appears twice (also at $.groups[1].ranks[0][1])"],
    ),
    (_set(("groups", 1, "ranks"), [[0, -1]]), "$.groups[1].ranks[0][1]", ["must be >= 0, got -1"]),
    (_set(("groups", 1, "ranks"), [[]]), "$.groups[1].ranks[0]", ["non-empty list"]),
    (_set(("groups", 1, "ranks"), "some"), "$.groups[1].ranks", ['expected "all" (every rank), "node"', 'got "some"']),
    (
        _set(("groups", 1, "name"), "tp"),
        "$.groups[1].name",
        ["duplicate group name 'tp' (also at $.groups[0].name)"],
    ),
    (
        _set(("groups", 1), {"name": "world", "size": 2}),
        "$.groups[1]",
        ["the world group is always every rank"],
    ),
    (_set(("groups", 0, "size"), 0), "$.groups[0].size", ["must be >= 1, got 0"]),
    (_set(("buffers", 1, "name"), "x"), "$.buffers[1].name", ["duplicate buffer or state name 'x'"]),
    (_set(("states", 0, "name"), "x"), "$.states[0].name", ["duplicate buffer or state name 'x'"]),
    (
        _set(("buffers", 0, "dtype"), "bf61"),
        "$.buffers[0].dtype",
        ["unknown dtype 'bf61'", "did you mean 'bf16'"],
    ),
    (
        _set(("buffers", 0, "shape", 1), "7168x"),
        "$.buffers[0].shape[1]",
        ["expected an int or an integer expression", "'7168x'"],
    ),
    (
        _set(("buffers", 0, "shape", 1), "hiden"),
        "$.buffers[0].shape[1]",
        [
            "unknown name 'hiden'",
            "known: experts, hidden, local_world_size, tokens, world_size",
            "did you mean 'hidden'",
        ],
    ),
    (
        _set(("buffers", 0, "shape", 1), "hidden ** 2"),
        "$.buffers[0].shape[1]",
        ["expected an int or an integer expression"],
    ),
    (_set(("buffers", 0, "shape", 1), "__import__('os')"), "$.buffers[0].shape[1]", ["expected an int"]),
    (_set(("buffers", 0, "shape", 1), 1.5), "$.buffers[0].shape[1]", ["got 1.5"]),
    (_set(("buffers", 0, "shape", 1), True), "$.buffers[0].shape[1]", ["got true"]),
    (_set(("buffers", 0, "shape", 0), 0), "$.buffers[0].shape[0]", ["must be >= 1, got 0"]),
    (_set(("buffers", 0, "shape"), "tokens"), "$.buffers[0].shape", ["expected a list"]),
    (_set(("buffers", 0, "export"), 1), "$.buffers[0].export", ["expected true or false"]),
    (
        _set(("buffers", 0, "group"), "tq"),
        "$.buffers[0].group",
        ["unknown group 'tq'", "known: world, tp, pairs"],
    ),
    (_set(("buffers", 0, "bind"), [1]), "$.buffers[0].bind", ["expected an object"]),
    (_set(("states", 0, "page_nbytes"), -1), "$.states[0].page_nbytes", ["must be >= 1"]),
    (_set(("states", 0, "pages"), 0), "$.states[0].pages", ["must be >= 1, got 0"]),
    (_set(("states", 0, "pages"), "4 - 4"), "$.states[0].pages", ["must be >= 1, got 0"]),
    (_set(("states", 0, "host_pages"), -1), "$.states[0].host_pages", ["must be >= 0, got -1"]),
    (_del("states", 0, "pages"), "$.states[0]", ["missing key 'pages'"]),
    (_set(("kernels", 1, "name"), "dispatch"), "$.kernels[1].name", ["duplicate kernel name"]),
    (_set(("kernels", 0, "options"), "-O3"), "$.kernels[0].options", ["expected a list"]),
    (_set(("kernels", 0, "options"), [3]), "$.kernels[0].options[0]", ["expected a string"]),
    (_set(("kernels", 0, "entry"), "tray-dispatch"), "$.kernels[0].entry", ["not a C identifier"]),
    (_set(("kernels", 0, "name"), "d.x"), "$.kernels[0]", ["not a C identifier"]),
    (_set(("programs", 1, "name"), "step"), "$.programs[1].name", ["duplicate program name"]),
    (_set(("programs", 0, "graph"), "yes"), "$.programs[0].graph", ["expected true or false"]),
    (
        _set((*OPS, 0, "kernel"), "dispach"),
        "$.programs[0].ops[0].kernel",
        ["unknown kernel 'dispach'; known: dispatch, combine; did you mean 'dispatch'?"],
    ),
    (
        _set((*OPS, 0, "op"), "lanch"),
        "$.programs[0].ops[0].op",
        ["unknown op 'lanch'", "did you mean 'launch'"],
    ),
    (_del(*OPS, 0, "op"), "$.programs[0].ops[0]", ["missing key 'op'; one of: launch, nccl"]),
    (_set((*OPS, 0, "peers"), True), "$.programs[0].ops[0].peers", ["unknown key 'peers' in launch op"]),
    (_del(*OPS, 0, "grid"), "$.programs[0].ops[0]", ["missing key 'grid' in launch op"]),
    (_set((*OPS, 0, "block"), [1, 2, 3, 4]), "$.programs[0].ops[0].block", ["1 to 3 dimensions"]),
    (_set((*OPS, 0, "shmem"), -4), "$.programs[0].ops[0].shmem", ["must be >= 0"]),
    (
        _set((*OPS, 0, "args", 2), "peers:y"),
        "$.programs[0].ops[0].args[2]",
        ["needs buffer 'y' to be exported"],
    ),
    (_set((*OPS, 0, "args", 2), "peers:z"), "$.programs[0].ops[0].args[2]", ["unknown buffer 'z'"]),
    (
        _set((*OPS, 0, "args", 3), "tokenz"),
        "$.programs[0].ops[0].args[3]",
        ["'tokenz' names no buffer", "peers:x", "did you mean 'tokens'"],
    ),
    (_set((*OPS, 0, "args", 1), "z@4"), "$.programs[0].ops[0].args[1]", ["names no buffer"]),
    (_set((*OPS, 0, "args", 1), "x@-4"), "$.programs[0].ops[0].args[1]", ["must be >= 0"]),
    (_set((*OPS, 0, "args", 1), "x@oops"), "$.programs[0].ops[0].args[1]", ["unknown name 'oops'"]),
    (_set((*OPS, 0, "args", 1), True), "$.programs[0].ops[0].args[1]", ["got true"]),
    (_set((*OPS, 0, "args", 1), None), "$.programs[0].ops[0].args[1]", ["got null"]),
    (
        _set((*OPS, 1, "collective"), "allgahter"),
        "$.programs[0].ops[1].collective",
        ["did you mean 'allgather'"],
    ),
    (
        _set((*OPS, 1, "group"), "pear"),
        "$.programs[0].ops[1].group",
        ["unknown group 'pear'", "did you mean 'pairs'"],
    ),
    (_set((*OPS, 1, "send"), "q"), "$.programs[0].ops[1].send", ["unknown buffer 'q'"]),
    (_set((*OPS, 1, "dtype"), "float"), "$.programs[0].ops[1].dtype", ["unknown dtype"]),
    (_set((*OPS, 1, "peer"), 1), "$.programs[0].ops[1]", ["'peer' is required for collective sendrecv"]),
    (_del(*OPS, 5, "peer"), "$.programs[0].ops[5]", ["'peer' is required for collective sendrecv"]),
    (_set((*OPS, 1, "op_name"), "allgather"), "$.programs[0].ops[1].op_name", ["unknown key 'op_name'"]),
    (_set((*OPS, 2, "accumulate"), 1), "$.programs[0].ops[2].accumulate", ["expected true or false"]),
    (_set((*OPS, 2, "k"), 0), "$.programs[0].ops[2].k", ["must be >= 1"]),
    (_set((*OPS, 3, "group"), "tpp"), "$.programs[0].ops[3].group", ["did you mean 'tp'"]),
    (_set((*OPS, 4, "src"), "w@"), "$.programs[0].ops[4].src", ["expected an int or an integer expression"]),
    (_set((*OPS, 4, "dst"), 7), "$.programs[0].ops[4].dst", ["expected a string"]),
    (_set((*OPS, 4), "copy"), "$.programs[0].ops[4]", ['expected an object (op), got "copy"']),
    (_set(("buffers", 0, "bind"), {"a": float("inf")}), "$.buffers[0].bind.a", ["finite number"]),
    (_set((*OPS, 0, "stage"), [1]), "$.programs[0].ops[0].stage", ["expected an object"]),
    (
        _set((*OPS, 0, "stage"), {"y": {"buffer": "y", "block": 4}}),
        "$.programs[0].ops[0].stage.y",
        ["'y' is not a peer table of this launch", "its peers: arguments: x"],
    ),
    (_set((*OPS, 0, "stage"), {"x": {"buffer": "y"}}), "$.programs[0].ops[0].stage.x", ["missing key 'block'"]),
    (_set((*OPS, 0, "stage"), {"x": {"buffer": "q", "block": 4}}), "$.programs[0].ops[0].stage.x.buffer",
     ["unknown buffer 'q'"]),
    (_set((*OPS, 1, "across"), "nodes"), "$.programs[0].ops[1].across", ["'across' is for collective alltoall only"]),
    (_set((*OPS, 1, "across"), "node"), "$.programs[0].ops[1].across", ["did you mean 'nodes'"]),
]


@pytest.mark.parametrize(("mutate", "json_path", "fragments"), LOAD_ERRORS)
def test_load_errors_name_file_and_json_path(
    root: Path, mutate: Any, json_path: str, fragments: list[str]
) -> None:
    doc = full_doc()
    mutate(doc)
    path, exc = load_error(root, doc)
    assert_error(path, exc, json_path, *fragments)


def test_staged_launch_and_alltoall_across_nodes_resolve(root: Path) -> None:
    doc = full_doc()
    ops = doc["programs"][0]["ops"]
    ops[0]["stage"] = {"x": {"buffer": "y", "block": "tokens * hidden * 2"}}
    ops.append({"op": "nccl", "collective": "alltoall", "group": "world", "send": "y", "recv": "y",
                "count": "tokens * hidden // world_size", "dtype": "bf16", "across": "nodes"})
    m = load_manifest(write(root, doc))
    r = m.resolve(4)
    launch, coll = r.program("step").ops[0], r.program("step").ops[-1]
    assert isinstance(launch, ResolvedLaunch) and isinstance(coll, ResolvedCollective)
    stage = launch.staged("x")
    assert stage is not None and stage.buffer == BufferRef("y") and stage.block == 128 * 7168 * 2
    assert launch.staged("y") is None and coll.across == "nodes"
    # the staging buffer must hold one block per member of the table's group
    ops[0]["stage"]["x"]["buffer"] = "x"
    with pytest.raises(ManifestError, match=r"stage\.x\.buffer: staging of peers:x \(4 members x 1835008 B\) needs"):
        load_manifest(write(root, doc)).resolve(4)


def test_missing_kernel_source_names_the_path(root: Path) -> None:
    doc = full_doc()
    doc["kernels"][1]["source"] = "kernels/combin.cu"
    path, exc = load_error(root, doc)
    assert_error(path, exc, "$.kernels[1].source", str(root / "kernels" / "combin.cu"), "cannot read")
    doc["kernels"][1]["source"] = "kernels"  # a directory
    path, exc = load_error(root, doc)
    assert_error(path, exc, "$.kernels[1].source", "cannot read kernel source")


def test_json_syntax_error_position(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "format": 1,\n  "name": "x",\n  "vars": {"a": 1,}\n}\n')
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    if "Illegal trailing comma" in str(info.value):  # Python 3.13's json names it itself, pointing at the comma
        assert_error(str(path), info.value, "line 4 column 18", "Illegal trailing comma before end of object")
        assert ':\n    "vars": {"a": 1,}\n                   ^' in str(info.value)
    else:
        assert_error(str(path), info.value, "line 4 column 19", "Expecting property name")
        assert "(a comma before a closing bracket or brace? JSON allows no trailing comma):\n" \
            '    "vars": {"a": 1,}\n                    ^' in str(info.value)
    path.write_text('{"format": 1, "name": "x" "vars": {}}')
    with pytest.raises(ManifestError, match="Expecting ',' delimiter \\(a missing comma between two items\\?\\)"):
        load_manifest(path)
    path.write_text("{'format': 1}")
    with pytest.raises(ManifestError, match="\\(JSON strings take double quotes\\)"):
        load_manifest(path)
    # a single-quoted key after a comma is the usual place for it; the hint was the trailing comma's there
    path.write_text('{"format": 1,\n  \'name\': "x"}')
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert "(JSON strings take double quotes)" in str(info.value) and "trailing comma" not in str(info.value)
    path.write_text('{"format": 1,, "name": "x"}')  # not a trailing comma: nothing closes after it
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert "trailing comma" not in str(info.value), info.value
    path.write_text('{"format": 1, "name": "x", "groups": [\n  {"name": "a", "size": 1},\n]}')
    with pytest.raises(ManifestError, match="JSON allows no trailing comma|Illegal trailing comma before end of array"):
        load_manifest(path)


def test_duplicate_json_key(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"format": 1, "name": "x", "vars": {"a": 1, "a": 2}}')
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert_error(str(path), info.value, "$.vars.a", "duplicate key 'a'")


def test_unreadable_and_non_object_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ManifestError) as info:
        load_manifest(missing)
    assert_error(str(missing), info.value, "$", "cannot read the manifest")
    for text, fragment in (("[1, 2]", "expected an object (manifest)"), ("\xff", "not UTF-8")):
        path = tmp_path / "odd.json"
        path.write_bytes(text.encode("latin-1"))
        with pytest.raises(ManifestError, match=re.escape(fragment)):
            load_manifest(path)


def test_a_manifest_path_that_is_no_regular_file_is_refused_without_blocking(tmp_path: Path) -> None:
    """A FIFO at a manifest's path blocked its reader (the head's loop, for a manifest a rank named) until someone
    wrote to it; a directory said only the OS's error."""
    import threading

    fifo = tmp_path / "m.fifo"
    os.mkfifo(fifo)
    errors: list[str] = []

    def load() -> None:
        try:
            load_manifest(fifo)
        except ManifestError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(5.0)
    if t.is_alive():  # let the reader go
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5.0)
        raise AssertionError("load_manifest blocked on a FIFO")
    assert len(errors) == 1 and "the manifest is not a regular file (a FIFO" in errors[0], errors
    with pytest.raises(ManifestError, match="the manifest is a directory; give a manifest file"):
        load_manifest(tmp_path)


def test_parse_manifest_in_memory(root: Path) -> None:
    doc = full_doc()
    doc["buffers"][0]["shape"] = ("tokens", "hidden")  # tuples read as lists
    m = parse_manifest(doc, "<memory>", str(root))
    assert m.path == "<memory>"
    assert m.digest == load_manifest(write(root, full_doc())).digest
    doc["vars"]["tokens"] = 1  # the manifest holds its own copy
    assert m.vars["tokens"] == 128 and m.doc["vars"]["tokens"] == 128
    with pytest.raises(ManifestError) as info:
        bad: Any = {"format": 1, "name": "x", "vars": {1: 2}}
        parse_manifest(bad, "<memory>", str(root))
    assert_error("<memory>", info.value, "$.vars[1]", "object keys must be strings")


# -- digest --------------------------------------------------------------------------------------


def test_digest_ignores_key_order_and_whitespace(root: Path) -> None:
    doc = full_doc()
    a = load_manifest(write(root, doc, "a.json"))
    reordered = json.loads(json.dumps(doc), object_pairs_hook=lambda pairs: dict(reversed(pairs)))
    b_path = root / "b.json"
    b_path.write_text(json.dumps(reordered, separators=(",", ":")))
    b = load_manifest(b_path)
    assert list(b.doc) != list(a.doc)
    assert a.digest == b.digest
    changed = copy.deepcopy(doc)
    changed["vars"]["tokens"] = 129
    assert load_manifest(write(root, changed, "c.json")).digest != a.digest


def test_digest_covers_kernel_sources(root: Path) -> None:
    path = write(root, full_doc())
    before = load_manifest(path).digest
    source = root / "kernels" / "combine.cu"
    data = bytearray(source.read_bytes())
    data[0] ^= 1
    source.write_bytes(bytes(data))
    assert load_manifest(path).digest != before
    data[0] ^= 1
    source.write_bytes(bytes(data))
    assert load_manifest(path).digest == before


def test_digest_golden(tmp_path: Path) -> None:
    # NOTE: the digest is a wire contract between ranks (and tray versions): this pins its definition.
    import hashlib

    m = builtin_manifest()
    canonical = json.dumps(m.doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    assert m.digest == hashlib.sha256(canonical).hexdigest()
    kernels = [{"name": "b", "source": "b.cu"}, {"name": "a", "source": "a.cu"}]
    m2 = parse_manifest({"format": 1, "name": "k", "kernels": kernels}, "<memory>", str(_kernel_pair_dir(tmp_path)))
    h = hashlib.sha256(json.dumps(m2.doc, sort_keys=True, separators=(",", ":")).encode())
    h.update(b"\0kernel\0a\0void a()")
    h.update(b"\0kernel\0b\0void b()")
    assert m2.digest == h.hexdigest()


def _kernel_pair_dir(d: Path) -> Path:
    (d / "a.cu").write_bytes(b"void a()")
    (d / "b.cu").write_bytes(b"void b()")
    return d


# -- builtin, repo manifest, inspect ---------------------------------------------------------------


def test_builtin_manifest() -> None:
    m = builtin_manifest()
    assert m.name == "minimal" and m.path == "<builtin>"
    assert m.description == "the world group and its barrier flags"
    assert [(g.name, g.ranks) for g in m.groups] == [("world", "all")]
    assert m.buffers == () and m.kernels == () and m.programs == ()
    assert builtin_manifest().digest == m.digest
    assert m.resolve(3).groups == {"world": ((0, 1, 2),)}


@pytest.mark.parametrize(("world_size", "local"), [(4, None), (4, 2), (6, 3)])
def test_tp_manifest_runs_tp_within_each_node(world_size: int, local: int | None) -> None:
    """Every TP op of tp_mlp.json is over the node group and its kernels get the node's size and index: on one
    node the same as world, on several one TP group per node."""
    from tray.manifest.builtin import builtin_path

    r = load_manifest(builtin_path("tp_mlp")).resolve(world_size, {"ll_max_count": 64}, local)
    per = local or world_size
    assert r.groups["node"] == tuple(tuple(range(s, s + per)) for s in range(0, world_size, per))
    assert all(b.group == "node" for b in r.buffers if b.export)
    assert r.buffer("ll_recv").shape == (8 * per * 16,)
    kinds = set()
    for program in r.programs.values():
        for op in program.ops:
            if isinstance(op, (ResolvedCollective, ResolvedBarrier)):
                assert op.group == "node", (program.name, op)
                kinds.add(type(op).__name__)
            if isinstance(op, ResolvedLaunch):
                assert ResolvedArg("int", name="world_size", value=world_size) not in op.args, (program.name, op)
                assert all(a.name != "world" for a in op.args if a.kind == "index"), (program.name, op)
                if op.kernel.startswith("tp_"):
                    assert ResolvedArg("int", name="local_world_size", value=per) in op.args, (program.name, op)
    assert kinds == {"ResolvedCollective", "ResolvedBarrier"}


def test_every_builtin_inspects_at_its_defaults() -> None:
    """`tray inspect NAME` (world size 4, no --var) works for every built-in manifest; a var that does not fit a
    world size is named with how to set it."""
    from tray.manifest.builtin import builtin_names, builtin_path

    for name in builtin_names():
        assert "digest" in format_inspect(load_manifest(builtin_path(name)), 4), name
    with pytest.raises(ManifestError, match=r"the manifest's defaults of groups, hidden, tokens do not fit "
                                            r"world_size 8: set them with --var NAME=INT"):
        load_manifest(builtin_path("ep_moe")).resolve(8)
    with pytest.raises(ManifestError, match=r"got 0 from 'max_tokens' with max_tokens=0; max_tokens given by --var$"):
        load_manifest(builtin_path("ep_moe")).resolve(4, {"max_tokens": 0})
    assert load_manifest(builtin_path("ep_moe")).resolve(8, {"groups": 8}).world_size == 8


def test_peer_barrier_manifest_loads() -> None:
    m = load_manifest(REPO / "manifests" / "peer_barrier.json")
    assert m.name == "peer_barrier" and m.vars == {"iters": 1000}
    (kernel,) = m.kernels
    assert (kernel.name, kernel.entry, kernel.peers) == ("peer_barrier", "tray_peer_barrier", True)
    assert kernel.source == str(REPO / "manifests" / "kernels" / "peer_barrier.cu")
    (op,) = m.program("barrier").ops
    assert op == BarrierSpec("world", "$.programs[0].ops[0]")
    for n in (1, 2, 4, 8):
        assert m.resolve(n).groups == {"world": (tuple(range(n)),)}


def test_a_group_size_that_does_not_divide_the_world_is_said_once() -> None:
    m = parse_manifest({"format": 1, "name": "g", "vars": {"tp": 2},
                        "groups": [{"name": "pairs", "size": 2}, {"name": "tp", "size": "tp"}]}, "<test>", ".")
    with pytest.raises(ManifestError, match=r"world_size 3 is not divisible by group 'pairs' size 2; run with a "
                                            r"multiple of 2 ranks$"):
        m.resolve(3)
    with pytest.raises(ManifestError, match=r"group 'tp' size 'tp' with tp=2 = 2; run with a multiple of 2 ranks$"):
        parse_manifest({**m.doc, "groups": m.doc["groups"][1:]}, "<test>", ".").resolve(3)


def test_format_inspect(root: Path) -> None:
    m = load_manifest(write(root, full_doc()))
    text = format_inspect(m, 4, {"tokens": 256})
    assert m.digest in text
    assert "tokens=256" in text and "world_size=4" in text
    assert "x            bf16[256, 7168]  3.5 MiB  export group=world" in text
    assert "y            bf16[1024, 7168]  14 MiB  local" in text
    assert "flag         u64[]  8 B  export group=world  bind" in text
    assert "kv           64 pages x 64 KiB = 4 MiB" in text
    assert "tp           2 instances of 2: [0,1] [2,3]" in text
    assert "barrier flags: u64[G] per group instance, implicit" in text
    assert "world: u64[4]" in text and "tp: u64[2] u64[2]" in text
    assert "entry tray_combine" in text and str(root / "kernels" / "combine.cu") in text
    assert "step         6 ops, graph=true" in text
    assert "launch dispatch grid=(256,1,1) block=(128,2,1) shmem=1024 args=[x, x@14336, peers:x" in text
    assert "nccl allgather group=tp send=x recv=y count=1835008 bf16" in text
    assert "gemm w = x @ x  m=8 n=8 k=8 bf16" in text
    assert "copy x@16 -> y  1 KiB" in text
    assert "nccl sendrecv" in text and "peer=1" in text
    assert "barrier pairs" in text
    # what load_weights will read on each rank (the file is not there: named, not checked)
    assert f"flag         rank 3: 1 tensor [flag.3] from {root / 'ckpt' / 'flag.safetensors'}" in text


def test_format_inspect_shows_an_alltoall_across_nodes_as_such() -> None:
    doc = {"format": 1, "name": "a", "buffers": [{"name": "b", "dtype": "u8", "shape": ["world_size"]}],
           "programs": [{"name": "p", "ops": [
               {"op": "nccl", "collective": "alltoall", "group": "world", "send": "b", "recv": "b", "count": 1,
                "dtype": "u8", "across": "nodes"},
               {"op": "nccl", "collective": "alltoall", "group": "world", "send": "b", "recv": "b", "count": 1,
                "dtype": "u8"}]}]}
    text = format_inspect(parse_manifest(doc, "<test>", "."), 4)
    assert "0 nccl alltoall group=world send=b recv=b count=1 u8 across=nodes\n" in text
    assert "1 nccl alltoall group=world send=b recv=b count=1 u8\n" in text


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 1 << 20, 3 << 30, (1 << 30) + 1)] == [
        "0 B", "1023 B", "1 KiB", "1.5 KiB", "1 MiB", "3 GiB", "1 GiB",
    ]  # fmt: skip


def test_dtype_table_matches_backend() -> None:
    base = pytest.importorskip("tray.backend.base")
    assert DTYPE_ITEMSIZE == base.DTYPE_ITEMSIZE


def test_package_imports_no_numpy_or_zmq() -> None:
    code = (
        "import sys, tray.manifest\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'zmq', 'msgpack'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# -- garbage in, ManifestError out ---------------------------------------------------------------

KNOWN_KEYS = sorted(
    {
        "format", "name", "description", "vars", "groups", "buffers", "states", "kernels", "programs",
        "ranks", "size", "dtype", "shape", "export", "group", "bind", "page_nbytes", "pages", "source",
        "entry", "options", "peers", "graph", "ops", "op", "kernel", "grid", "block", "shmem", "args",
        "collective", "send", "recv", "count", "peer", "a", "b", "c", "m", "n", "k", "accumulate", "src",
        "dst", "bytes",
    }
)  # fmt: skip
WORDS = [
    "world", "tp", "all", "x", "y", "x@4", "x@-1", "peers:x", "peers:y", "tokens", "hidden", "world_size",
    "tokens*hidden", "1//0", "bf16", "u64", "launch", "nccl", "gemm", "barrier", "copy", "allgather",
    "sendrecv", "dispatch", "kernels/dispatch.cu", "../", "", "\x00", "\ud800", "(", "9" * 30,
]  # fmt: skip

leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-3, 9)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | st.sampled_from(WORDS)
)
keys = st.sampled_from(KNOWN_KEYS) | st.text(max_size=5)
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=24,
)


@pytest.fixture(scope="module")
def garbage_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("garbage")
    make_kernels(d)
    return d


def _only_manifest_errors(doc: Any, base_dir: Path) -> None:
    try:
        m = parse_manifest(doc, "<fuzz>", str(base_dir))
    except ManifestError as exc:
        assert exc.path == "<fuzz>" and exc.json_path
        return
    for world_size in (1, 2, 4):
        try:
            format_inspect(m, world_size)
        except ManifestError:
            pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(keys, values, max_size=8), st.booleans())
def test_random_documents_raise_only_manifest_error(
    garbage_root: Path, doc: dict[Any, Any], header: bool
) -> None:
    if header:
        doc = {**doc, "format": 1, "name": "fuzz"}
    _only_manifest_errors(doc, garbage_root)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += _paths(item, (*prefix, i))
    return out


FULL_PATHS = _paths(full_doc())


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(FULL_PATHS), values | st.just(...)), min_size=1, max_size=3))
def test_mutated_documents_raise_only_manifest_error(
    garbage_root: Path, edits: list[tuple[Any, Any]]
) -> None:
    doc = full_doc()
    for path, value in edits:
        target = doc
        try:
            for key in path[:-1]:
                target = target[key]
            if value is ...:
                del target[path[-1]]
            else:
                target[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or replaced this path
    _only_manifest_errors(doc, garbage_root)


# -- states: the optional host tier (host_pages) --------------------------------------------------


def test_state_host_pages_default_int_and_expr(root: Path) -> None:
    doc = full_doc()
    r = load_manifest(write(root, doc)).resolve(4)
    assert (r.states[0].pages, r.states[0].host_pages) == (64, 64)  # not given: the host tier holds all
    assert r.states[0].host_nbytes == r.states[0].nbytes
    plain_digest = load_manifest(write(root, doc)).digest

    doc["states"][0]["host_pages"] = 12
    m = load_manifest(write(root, doc))
    assert m.states[0].host_pages == 12 and m.digest != plain_digest
    r = m.resolve(4)
    assert r.states[0].host_pages == 12 and r.states[0].host_nbytes == 12 * 65536
    assert "kv           64 pages x 64 KiB = 4 MiB  host tier 12 pages = 768 KiB" in format_inspect(m, 4)

    doc["states"][0]["host_pages"] = "2 * world_size + tokens // 64"
    r = load_manifest(write(root, doc)).resolve(8)
    assert r.states[0].host_pages == 2 * 8 + 2
    doc["states"][0]["host_pages"] = 0  # a state that never parks: no pinned host memory
    assert load_manifest(write(root, doc)).resolve(4).states[0].host_nbytes == 0


@pytest.mark.parametrize(
    ("value", "world_size", "fragments"),
    [
        (-1, 4, ["must be >= 0, got -1"]),
        (True, 4, ["got true"]),
        ("hiden", 4, ["unknown name 'hiden'", "did you mean 'hidden'"]),
        ("world_size - 8", 4, ["must be >= 0, got -4 from"]),
        ("2**70", 4, ["expected an int or an integer expression"]),
    ],
)
def test_state_host_pages_errors(root: Path, value: Any, world_size: int, fragments: list[str]) -> None:
    doc = full_doc()
    doc["states"][0]["host_pages"] = value
    with pytest.raises(ManifestError) as info:
        load_manifest(write(root, doc)).resolve(world_size)
    assert_error(write(root, doc), info.value, "$.states[0].host_pages", *fragments)


def test_state_host_pages_unknown_key_lists_it(root: Path) -> None:
    doc = full_doc()
    doc["states"][0]["host_page"] = 3
    path, exc = load_error(root, doc)
    assert_error(path, exc, "$.states[0].host_page", "allowed: name, page_nbytes, pages, host_pages",
                 "did you mean 'host_pages'")


def test_kernel_programmatic_flag() -> None:
    m = load_manifest(REPO / "manifests" / "tp_mlp.json")
    flags = {k.name: k.programmatic for k in m.kernels}
    assert flags["tp_sum_peers"] and flags["tp_rs_peers"] and flags["tp_ag_peers"] and not flags["ep_fill"]


def test_did_you_mean_takes_a_name_that_differs_only_in_case():
    from tray.manifest.expr import did_you_mean

    assert did_you_mean("Go", ["go", "stop"]) == "; did you mean 'go'?"
    assert did_you_mean("stmap", ["stamp"]) == "; did you mean 'stamp'?"


def test_twin_views_are_judged_only_inside_the_memory_tray_mapped():
    import numpy as np

    from tray import twins
    from tray.errors import UsageError

    buf, own = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    base = buf.ctypes.data
    twins.add_region(base, 32)
    try:
        assert twins.at(base, 32, np.uint8).size == 32
        with pytest.raises(UsageError, match=r"reaches 33 B at 0x[0-9a-f]+ \(0 B into a region of 32 B\)"):
            twins.at(base, 33, np.uint8)
        with pytest.raises(UsageError, match=r"8 B into a region of 32 B"):
            twins.u64_at(base + 8, 4)
        assert twins.u32_at(own.ctypes.data, 16).size == 16  # memory of the program's own: not judged
    finally:
        twins.remove_region(base)
    assert twins.at(base, 64, np.uint8).size == 64  # nothing registered: nothing checked


def test_an_entry_its_source_does_not_name_is_refused_with_the_kernels_it_defines(root: Path) -> None:
    """A typo in "entry" passed `tray inspect` and every host run, to fail on a GPU alone (the module lacks the
    symbol); a source that includes files or pastes tokens may define it out of sight and is not judged."""
    (root / "kernels" / "two.cu").write_text(
        'extern "C" __global__ void my_fill(float* y) {}\n'
        'extern "C" __global__ void __launch_bounds__(128) my_scale(float* y) {}\n')
    doc = {"format": 1, "name": "t", "kernels": [{"name": "fill", "source": "kernels/two.cu", "entry": "my_fil"}]}
    path, exc = load_error(root, doc)
    assert_error(path, exc, "$.kernels[0].entry", 'entry "my_fil" is not in its source',
                 "it defines my_fill, my_scale; did you mean 'my_fill'?")
    doc["kernels"][0]["entry"] = "my_scale"
    load_manifest(write(root, doc))
    (root / "kernels" / "made.cu").write_text('#include "k.cuh"\nMAKE_KERNEL(my_fill)\n')
    doc["kernels"] = [{"name": "fill", "source": "kernels/made.cu", "entry": "tray_fill"}]
    load_manifest(write(root, doc))   # out of sight: not judged


def test_a_collective_whose_dtype_is_not_its_buffers_is_refused(root: Path) -> None:
    """An allreduce in f32 over i32 buffers passed `tray inspect` and ran, summing integers' bytes as floats."""
    doc = node_doc()
    doc["buffers"][0]["dtype"] = "i32"
    path = write(root, doc)
    with pytest.raises(ManifestError) as info:
        load_manifest(path).resolve(4)
    assert_error(path, info.value, "$.programs[0].ops[1].dtype", "allreduce of count 64 bf16 over group 'node'",
                 "its send buffer 'part' holds i32; the op's dtype must be its buffers'")


def test_a_sendrecv_peer_that_pairs_no_member_with_its_partner_is_refused(root: Path) -> None:
    """`peer` counts from the member (member i exchanges with i + peer mod G); a peer whose partner would name
    another member (a ring offset) would hang NCCL, so only 0 and G/2 resolve."""
    doc = {"format": 1, "name": "ring", "groups": [{"name": "world", "ranks": "all"}],
           "buffers": [{"name": "a", "dtype": "f32", "shape": [4]}, {"name": "b", "dtype": "f32", "shape": [4]}],
           "programs": [{"name": "swap", "ops": [{"op": "nccl", "collective": "sendrecv", "group": "world",
                                                  "send": "a", "recv": "b", "count": 4, "dtype": "f32", "peer": 1}]}]}
    path = write(root, doc)
    load_manifest(path).resolve(2)  # the other member of two
    with pytest.raises(ManifestError) as info:
        load_manifest(path).resolve(4)
    assert_error(path, info.value, "$.programs[0].ops[0].peer", "peer 1 pairs member i of group 'world' with member",
                 "in instances of 4 ranks is not a partner naming it back (or is itself)")
    doc["programs"][0]["ops"][0]["peer"] = 2
    load_manifest(write(root, doc)).resolve(4)
    doc["groups"] = [{"name": "uneven", "ranks": [[0, 1, 2, 3], [4, 5]]}]   # peer 2 in an instance of 2: itself
    doc["programs"][0]["ops"][0]["group"] = "uneven"
    with pytest.raises(ManifestError, match="in instances of 2 ranks is not a partner"):
        load_manifest(write(root, doc)).resolve(6)


def test_the_references_top_level_snippets_load_together() -> None:
    """docs/manifest.md's `"vars"`, `"groups"`, `"buffers"`, `"states"` and `"programs"` snippets, put in one
    manifest, load and resolve for 4 ranks (a snippet naming what does not exist fails here)."""
    text = (REPO / "docs" / "manifest.md").read_text()
    keys = ("vars", "groups", "buffers", "states", "programs")
    parts = [b.strip() for b in re.findall(r"```json\n(.*?)```", text, re.S)
             if b.lstrip().startswith(tuple(f'"{k}"' for k in keys))]
    doc: dict[str, Any] = {"format": 1, "name": "snippets"}
    for part in parts:
        for key, value in json.loads("{" + part + "}").items():
            doc[key] = {**doc[key], **value} if key == "vars" and key in doc else value
    assert set(keys) <= set(doc), sorted(doc)
    parse_manifest(doc, "docs/manifest.md", str(REPO)).resolve(4)


def test_a_world_past_any_jobs_is_refused_before_its_ranks_are_listed():
    """A job of 2**32 ranks (--nnodes x -n) built a tuple of every rank for a group of "all": gigabytes and the OOM
    killer, or past 2**63 an OverflowError's traceback."""
    from tray.errors import UsageError
    from tray.manifest.builtin import builtin_manifest

    m = builtin_manifest()
    for n in (1 << 32, 10 ** 30):
        with pytest.raises(UsageError, match=f"a world of {n} ranks: at most 1048576"):
            m.resolve(n)
    assert m.resolve(1 << 20).world_size == 1 << 20


def test_an_unknown_group_of_an_index_argument_names_world_once(root: Path) -> None:
    """A manifest that declares "world" itself heard "known: world, world"."""
    doc = full_doc()
    doc["groups"].append({"name": "world", "ranks": "all"})
    doc["programs"][0]["ops"][0]["args"][2] = "index:nope"
    with pytest.raises(ManifestError) as info:
        parse_manifest(doc, "m.json", str(root))
    assert "known: tp, pairs, world" in str(info.value) and "world, world" not in str(info.value), str(info.value)
