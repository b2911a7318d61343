"""Messages between heads and the root: round trips, refusals, and which ranks vote on a step."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import fields

import msgpack
import pytest

from tray.errors import WireError
from tray.handshake import jobwire, wire
from tray.handshake.steps import group_topic, spans_nodes, step_voters

TOKEN = "t" * 32


MESSAGES = [
    jobwire.NodeJoin(token=TOKEN, node_rank=1, nnodes=2, local_world_size=2, rdzv_id="j", hostname="h", pid=9,
                     manifest="a" * 64, backend="host"),
    jobwire.NodeOffers(token=TOKEN, node_rank=1, joins={3: {"tray:leaders:ep": b"\x03" * 128}}),
    jobwire.NodeOffers(token=TOKEN, node_rank=0, joins={}),
    jobwire.JobTable(token=TOKEN, joins={0: {"tray:leaders:world": b"\x01" * 128, "tray:leaders:x": b"\x02"},
                                         3: {"tray:leaders:ep": b"\x03" * 128}}),
    jobwire.NodeReady(token=TOKEN, node_rank=1, timings={"table": 0.25}),
    jobwire.JobGo(token=TOKEN, t_go=12.5),
    jobwire.NodeVote(token=TOKEN, node_rank=1, topic="x", round=3, ranks=(2, 3), values=({"a": [1, 2]}, None),
                     waits=(5.0, 0.0)),
    jobwire.NodeHeld(token=TOKEN, node_rank=1, topics=("x", "y"), rounds=(3, 1), ranks=(2, 3), waits=(4.5, 0.0)),
    jobwire.JobDecision(token=TOKEN, topic="x", round=3, ranks=(0, 1, 2, 3), values=(1, b"2", None, "4"),
                        missing=(2,), waited_s=2.0),
    jobwire.NodeFailure(token=TOKEN, node_rank=1, rank=3, summary="rank 3 died", report="tb", tail=("a", "b"),
                        exit_code=1),
    jobwire.JobStop(token=TOKEN, node_rank=-1, rank=-1, summary="node 1 lost", report="", tail=(), exit_code=3,
                    pending_topics=("x", "y"), pending_rounds=(3, 1), pending_missing=((3,), (0, 2))),
    jobwire.NodeDone(token=TOKEN, node_rank=1),
    jobwire.NodeLeft(token=TOKEN, node_rank=1, rank=3, how="exited with code 0"),
    jobwire.JobEnd(token=TOKEN, nnodes=2),
    jobwire.Beat(token=TOKEN, node_rank=0, seq=7),
]


def test_every_kind_is_covered_and_its_field_table_matches_the_dataclass():
    assert {type(m) for m in MESSAGES} == set(jobwire.KINDS.values())
    for cls in jobwire.KINDS.values():
        assert tuple(cls.FIELDS) == tuple(f.name for f in fields(cls) if f.name != "token"), cls


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.KIND)
def test_round_trip(msg):
    data = msg.to_msgpack()
    assert jobwire.decode(data, token=TOKEN) == msg
    assert msg.to_msgpack() == data  # deterministic bytes


def test_refusals_name_the_fault():
    good = MESSAGES[0].to_body()
    with pytest.raises(WireError, match="wrong token"):
        jobwire.decode(MESSAGES[0].to_msgpack(), token="u" * 32)
    with pytest.raises(WireError, match="unknown kind 'offer'"):
        jobwire.decode(msgpack.packb({**good, "kind": "offer"}), token=TOKEN)
    with pytest.raises(WireError, match="unknown field 'extra'"):
        jobwire.decode(msgpack.packb({**good, "extra": 1}), token=TOKEN)
    with pytest.raises(WireError, match="field 'node_rank': expected int >= 0, got -1"):
        jobwire.decode(msgpack.packb({**good, "node_rank": -1}), token=TOKEN)
    with pytest.raises(WireError, match="protocol version"):
        jobwire.decode(msgpack.packb({**good, "v": 99}), token=TOKEN)
    with pytest.raises(WireError, match="not valid msgpack"):
        jobwire.decode(b"\xc1garbage", token=TOKEN)
    table = next(m for m in MESSAGES if m.KIND == "job_table").to_body()
    with pytest.raises(WireError, match=r"field 'joins\[1\]\[0\]': ranks in increasing order, got 0 after 3"):
        jobwire.decode(msgpack.packb({**table, "joins": table["joins"][::-1]}), token=TOKEN)
    with pytest.raises(WireError, match=r"field 'joins\[0\]\[1\]\['g'\]': expected at most 4096 bytes, got 4097"):
        jobwire.decode(msgpack.packb({**table, "joins": [[0, {"g": bytes(4097)}]]}), token=TOKEN)
    with pytest.raises(WireError, match=r"field 'joins\[0\]': expected \[rank, map\]"):
        jobwire.decode(msgpack.packb({**table, "joins": [[0]]}), token=TOKEN)
    with pytest.raises(WireError, match="cannot encode beat"):
        jobwire.Beat(token=TOKEN, node_rank=0, seq=-1).to_msgpack()


@pytest.mark.parametrize(("kind", "field"), [("node_vote", "values"), ("node_vote", "waits"), ("node_held", "rounds"),
                                             ("job_decision", "values"), ("job_stop", "pending_missing")])
def test_lists_of_one_entry_per_rank_or_step_must_be_of_one_length(kind, field):
    """A node's votes are `ranks[i]` with `values[i]` waiting `waits[i]`; lists of other lengths were zipped, their
    extra entries dropped unsaid (rank 3's vote lost, a step waiting for it for good): refused, both ways."""
    msg = next(m for m in MESSAGES if m.KIND == kind)
    body = msg.to_body()
    body[field] = body[field][:-1]
    with pytest.raises(WireError, match=f"differ in length: .*'{field}' {len(body[field])}"):
        jobwire.decode(msgpack.packb(body), token=TOKEN)
    with pytest.raises(WireError, match=f"cannot encode {kind}: .*differ in length"):
        dataclasses.replace(msg, **{field: getattr(msg, field)[:-1]}).to_msgpack()

def test_a_decision_of_every_rank_is_checked_whole_and_a_bad_entry_still_named(monkeypatch):
    """A decision holds a value of each of the job's W ranks, checked where the root builds it and at every head: the
    per-rank lists are checked whole, with no call (and no field path made) per entry, and one bad entry is still named
    by its place."""
    calls = [0]

    def counted(check):  # type: ignore[no-untyped-def]
        def call(*a, **k):  # type: ignore[no-untyped-def]
            calls[0] += 1
            return check(*a, **k)
        return call

    for module in (wire, jobwire):
        for name in ("_as_int", "_as_float", "_as_plain", "_as_str"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counted(getattr(module, name)))
    w = 1024
    decision = jobwire.JobDecision(token=TOKEN, topic="x", round=3, ranks=tuple(range(w)),
                                   values=tuple(r if r % 2 else f"v{r}" for r in range(w)), missing=(), waited_s=2.0)
    assert jobwire.decode(decision.to_msgpack(), token=TOKEN) == decision
    vote = jobwire.NodeVote(token=TOKEN, node_rank=1, topic="x", round=3, ranks=tuple(range(w)), values=(None,) * w,
                            waits=(1.5,) * w)
    assert jobwire.decode(vote.to_msgpack(), token=TOKEN) == vote
    assert calls[0] < 50, calls[0]
    for field, bad, said in (("ranks", -1, "expected int >= 0, got -1"), ("waits", "x", "expected float, got str"),
                             ("values", [[[[[[[[[1]]]]]]]]], "nested deeper than 8 levels")):
        body = vote.to_body()
        body[field][700] = bad
        with pytest.raises(WireError, match=re.escape(f"field '{field}[700]") + ".*" + re.escape(said)):
            jobwire.decode(msgpack.packb(body), token=TOKEN)


def test_step_voters_and_spanning():
    groups = {"world": ((0, 1, 2, 3),), "pairs": ((0, 1), (2, 3))}
    assert step_voters("park", 4, groups) == (0, 1, 2, 3)
    assert step_voters(group_topic("pairs", (2, 3), "barrier"), 4, groups) == (2, 3)
    assert step_voters(group_topic("world", (0, 1, 2, 3), "gather"), 4, groups) == (0, 1, 2, 3)
    assert step_voters("tray:group:pairs@1:barrier", 4, groups) is None   # no instance led by rank 1
    assert step_voters("tray:group:nope@0:barrier", 4, groups) is None
    assert spans_nodes((0, 1, 2, 3), 2) and not spans_nodes((2, 3), 2) and spans_nodes((1, 2), 2)


def test_a_failure_of_long_lines_is_cut_to_fit_one_message():
    """20 last lines of 64 KiB and a long report are 1.3 MB: over the message cap, so the node's head failed
    with a WireError and the root named the node lost instead of the rank's error. `bounded` keeps the report's
    end (a traceback's cause), each line's start and the summary's start, cut between UTF-8 characters."""
    tail = tuple(("é" * 40_000) + f" line {i}" for i in range(20))   # 80 KB of UTF-8 each
    report = "Traceback ...\n" + "x" * 2_000_000 + "\nRuntimeError: the cause"
    with pytest.raises(WireError, match="exceeds"):
        jobwire.NodeFailure(token=TOKEN, node_rank=1, rank=3, summary="s", report=report, tail=tail,
                            exit_code=1).to_msgpack()
    msg = jobwire.NodeFailure.bounded(token=TOKEN, node_rank=1, rank=3, summary="rank 3 " + "y" * 100_000,
                                      report=report, tail=tail, exit_code=1)
    data = msg.to_msgpack()
    assert len(data) <= wire.MAX_MESSAGE_NBYTES and jobwire.decode(data, token=TOKEN) == msg
    assert msg.report.endswith("RuntimeError: the cause") and msg.report.startswith("...")
    assert msg.summary.startswith("rank 3 ") and msg.summary.endswith("...")
    assert len(msg.tail) == 20 and all(line.startswith("éé") and line.endswith("...") for line in msg.tail)
    short = jobwire.JobStop.bounded(token=TOKEN, node_rank=1, rank=3, summary="s", report="r", tail=("a",),
                                    exit_code=1)
    assert (short.summary, short.report, short.tail) == ("s", "r", ("a",))


@pytest.mark.parametrize("kind", ["node_failure", "job_stop"])
def test_a_failures_exit_code_is_one_a_process_can_exit_with(kind):
    """Every head exits with the job's failure's exit code; 256 would have made each of them exit 0 (success)."""
    msg = next(m for m in MESSAGES if m.KIND == kind)
    for code in (256, 2**63):
        with pytest.raises(WireError, match=f"field 'exit_code': expected an exit code of at most 255, got {code}"):
            jobwire.decode(msgpack.packb({**msg.to_body(), "exit_code": code}), token=TOKEN)
    assert jobwire.decode(msgpack.packb({**msg.to_body(), "exit_code": 255}), token=TOKEN).exit_code == 255


def test_manifests_of_two_nodes_are_compared_part_by_part():
    from tray.manifest.digest import part_digests, parts_differing
    doc = {"name": "m", "programs": {"step": []}, "buffers": []}
    ours = part_digests(doc, {"k": b"a"})
    assert parts_differing(ours, ours) == []
    theirs = part_digests({**doc, "programs": {"step": [{"barrier": "world"}]}, "states": []}, {"k": b"b", "j": b""})
    assert parts_differing(theirs, ours) == ["programs", "the source of kernel 'j'", "the source of kernel 'k'",
                                             "states"]
    said = jobwire.manifest_differs("a" * 64, "b" * 64, theirs, ours)
    assert said.startswith("manifest aaaaaaaaaaaa..., node 0 loaded bbbbbbbbbbbb... (they differ in programs, "), said
    assert "(they differ" not in jobwire.manifest_differs("a" * 64, "b" * 64)  # a node that sent no parts


def test_the_root_deflates_a_large_message_and_a_head_inflates_it_within_its_limit():
    """A message of 16 KiB or more goes from the root deflated, as two frames: the same bytes come out, within the
    job's limit; a frame that inflates past the limit (a deflate bomb), does not inflate, or is framed otherwise is
    refused, and a small message stays one frame."""
    import zlib

    small = jobwire.Beat(token=TOKEN, node_rank=0, seq=1).to_msgpack()
    assert jobwire.frames_of(small) == [small] and jobwire.message_of([small], 1 << 20) == small
    n = 4096
    values = tuple({"step": 7, "ok": True} for _ in range(n))
    table = jobwire.JobDecision(token=TOKEN, topic="x", round=1, ranks=tuple(range(n)), values=values, missing=(),
                                waited_s=0.0).to_msgpack(1 << 20)
    assert len(table) >= jobwire.DEFLATE_FROM
    frames = jobwire.frames_of(table)
    assert frames[0] == b"z" and len(frames) == 2 and len(frames[1]) < len(table) // 4
    assert jobwire.message_of(frames, 1 << 20) == table
    with pytest.raises(WireError, match=f"inflates past the limit of {len(table) - 1} bytes"):
        jobwire.message_of(frames, len(table) - 1)
    bomb = zlib.compress(bytes(64 << 20), 9)  # 64 MiB of zeros in ~64 KB
    with pytest.raises(WireError, match="inflates past the limit of 1048576 bytes"):
        jobwire.message_of([b"z", bomb], 1 << 20)
    with pytest.raises(WireError, match="does not inflate"):
        jobwire.message_of([b"z", b"not deflate"], 1 << 20)
    with pytest.raises(WireError, match="does not end where its frame does"):
        jobwire.message_of([b"z", frames[1][:-10]], 1 << 20)
    with pytest.raises(WireError, match="does not end where its frame does"):
        jobwire.message_of([b"z", frames[1] + b"tail"], 1 << 20)
    with pytest.raises(WireError, match=r"expected 1 frame, or 2 \(b'z' and a deflated message\), got 3"):
        jobwire.message_of([b"z", frames[1], b""], 1 << 20)
    with pytest.raises(WireError, match=r"expected b'z' as the first of 2 frames, got b'x'"):
        jobwire.message_of([b"x", frames[1]], 1 << 20)
    noise = __import__("os").urandom(64 << 10)  # what deflate cannot shrink goes as it is
    assert jobwire.frames_of(noise) == [noise]
