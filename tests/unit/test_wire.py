"""Wire format of the handshake: round trips, golden bytes, refusals, and fuzzing with garbage."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tray.errors import WireError
from tray.handshake.wire import (
    KINDS,
    MAX_MESSAGE_NBYTES,
    PROTOCOL_VERSION,
    BufferOffer,
    Bye,
    Decision,
    DeviceIdentity,
    ErrorReport,
    Go,
    Heartbeat,
    Message,
    Offer,
    Ready,
    Reject,
    Table,
    Vote,
    decode,
    encode,
)

TOKEN = "s3cret-token"
MANIFEST = "0123456789abcdef" * 4


def _offer(rank: int = 0, world_size: int = 4, token: str = TOKEN) -> Offer:
    return Offer(
        token=token,
        rank=rank,
        world_size=world_size,
        host="6f1c2d3e-boot",
        pid=1000 + rank,
        uid=1000,
        device=DeviceIdentity(
            ordinal=rank, uuid=f"GPU-{rank:04d}", pci_bus=f"0000:{rank:02x}:00.0", numa_node=-1
        ),
        backend="cuda",
        manifest=MANIFEST,
        fd_socket=f"/tmp/tray/rank-{rank}.fds",
        buffers=(
            BufferOffer(name="kv", nbytes=1 << 20, handle="fabric", fabric=bytes([rank]) * 64),
            BufferOffer(name="flags", nbytes=4096, handle="memfd", fabric=None),
        ),
        groups={"tp": bytes([rank + 1]) * 128, "dp": b""} if rank == 0 else {},
        timings={"import": 0.25, "allocate": 1.5},
    )


SAMPLES: list[Message] = [
    _offer(),
    _offer(rank=3),
    Table(token=TOKEN, offers=tuple(_offer(rank=r) for r in range(4))),
    Table(token=TOKEN, offers=()),
    Ready(token=TOKEN, rank=2, timings={"connect": 0.125}),
    Go(token=TOKEN, t_go=1_760_000_000.123456),
    ErrorReport(
        token=TOKEN,
        rank=1,
        phase="allocate",
        error_type="DeviceError",
        message="cuMemCreate failed",
        traceback="Traceback (most recent call last):\n  ...\n",
    ),
    Heartbeat(token=TOKEN, rank=0, phase="connect", seq=17),
    Bye(token=TOKEN, rank=3),
    Vote(token=TOKEN, rank=1, topic="batch", round=2, value={"n": 3, "names": ["a", "b"], "raw": b"\x00"}),
    Vote(token=TOKEN, rank=0, topic="x", round=0, value=None),
    Decision(token=TOKEN, topic="batch", round=2, values=(1, 2.5, "three", None, [True], {"k": b"v"})),
    Reject(token=TOKEN, reason="offer: field 'rank': expected int, got str"),
    Table(token=TOKEN, offers=tuple(_offer(rank=r, world_size=8) for r in range(4, 6)),
          joins={0: {"tray:leaders:world": b"\x07" * 128}, 7: {"tray:leaders:ep": b"\x08" * 128}}),
]


def _raw(body: object) -> bytes:
    """Bytes of any body, bypassing encode()'s checks: what a buggy or hostile peer could send."""
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


def _body(msg: Message) -> dict[str, Any]:
    body: dict[str, Any] = msgpack.unpackb(encode(msg), raw=False)
    return body


def _refused(data: bytes, reason: str, *, token: str | None = TOKEN, sender: str | None = None) -> WireError:
    with pytest.raises(WireError) as info:
        decode(data, token=token, sender=sender)
    assert reason in info.value.reason, info.value.reason
    return info.value


# --- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    data = encode(msg)
    assert decode(data, token=TOKEN) == msg
    assert decode(data, token=None) == msg
    assert encode(msg) == data  # deterministic


def test_every_kind_has_a_sample() -> None:
    assert {type(m).KIND for m in SAMPLES} == set(KINDS)


def test_table_nests_offers_without_envelope() -> None:
    table = SAMPLES[2]
    assert isinstance(table, Table)
    body = _body(table)
    assert list(body) == ["kind", "v", "token", "offers", "joins"]
    assert all(not {"kind", "v", "token"} & set(o) for o in body["offers"])
    back = decode(encode(table), token=TOKEN)
    assert isinstance(back, Table) and back.offers[0].groups["tp"] == b"\x01" * 128
    assert back.offers[3].buffers[0].fabric == b"\x03" * 64
    assert back.offer(3) is back.offers[3] and back.join_info(0, "tp") == b"\x01" * 128


def test_a_nodes_table_holds_its_own_offers_and_the_join_info_of_other_nodes() -> None:
    """In a job of several nodes a rank's table holds its node's offers (consecutive ranks) and, of other nodes' ranks,
    only the join info they offered: a lookup of another node's offer names what the table holds."""
    table = SAMPLES[-1]
    assert isinstance(table, Table)
    back = decode(encode(table), token=TOKEN)
    assert back == table and back.offer(5).rank == 5
    assert back.join_info(0, "tray:leaders:world") == b"\x07" * 128 and back.join_info(7, "tray:leaders:x") == b""
    assert back.join_info(4, "tp") == b"" and back.join_info(6, "tray:leaders:world") == b""
    with pytest.raises(WireError, match=r"the table holds ranks 4\.\.5 \(this node's\), not rank 6"):
        back.offer(6)
    with pytest.raises(WireError, match="the table holds no offer"):
        Table(token=TOKEN, offers=()).offer(0)
    with pytest.raises(WireError, match=r"offers\[1\]\.rank': expected 5 \(one node's ranks, in order\), got 6"):
        encode(Table(token=TOKEN, offers=(_offer(4, 8), _offer(6, 8))))
    with pytest.raises(WireError, match="joins': rank 5's join info beside its offer"):
        encode(dataclasses.replace(table, joins={5: {"g": b"x"}}))


def test_maps_are_sorted_so_bytes_do_not_depend_on_insertion_order() -> None:
    a = Ready(token=TOKEN, rank=0, timings={"b": 1.0, "a": 2.0})
    b = Ready(token=TOKEN, rank=0, timings={"a": 2.0, "b": 1.0})
    assert encode(a) == encode(b)
    va = Vote(token=TOKEN, rank=0, topic="t", round=0, value={"z": 1, "a": (1, 2)})
    vb = Vote(token=TOKEN, rank=0, topic="t", round=0, value={"a": [1, 2], "z": 1})
    assert encode(va) == encode(vb)
    assert decode(encode(va), token=TOKEN) == vb  # tuples come back as lists


def test_int_timings_become_floats() -> None:
    back = decode(_raw({**_body(SAMPLES[4]), "timings": {"connect": 3}}), token=TOKEN)
    assert isinstance(back, Ready) and back.timings == {"connect": 3.0}
    assert type(back.timings["connect"]) is float
    go = decode(_raw({**_body(SAMPLES[5]), "t_go": 5}), token=TOKEN)
    assert isinstance(go, Go) and type(go.t_go) is float


# --- golden bytes -----------------------------------------------------------------------------------

GOLDEN_OFFER = Offer(
    token="tok-golden",
    rank=1,
    world_size=2,
    host="boot-1234",
    pid=4242,
    uid=1000,
    device=DeviceIdentity(ordinal=1, uuid="GPU-0011", pci_bus="0000:1b:00.0", numa_node=0),
    backend="cuda",
    manifest="ab" * 32,
    fd_socket="/tmp/tray/rank-1.fds",
    buffers=(
        BufferOffer(name="kv", nbytes=4096, handle="fabric", fabric=bytes(range(64))),
        BufferOffer(name="flags", nbytes=64, handle="posix", fabric=None),
    ),
    groups={"tp": bytes(range(128))},
    timings={"import": 0.5, "alloc": 2.0},
    manifest_path="/srv/m.json",
)
GOLDEN_OFFER_HEX = (
    "de0010a46b696e64a56f66666572a17608a5746f6b656eaa746f6b2d676f6c64656ea472616e6b01aa776f726c645f73"
    "697a6502a4686f7374a9626f6f742d31323334a3706964cd1092a3756964cd03e8a664657669636584a76f7264696e61"
    "6c01a475756964a84750552d30303131a77063695f627573ac303030303a31623a30302e30a96e756d615f6e6f646500"
    "a76261636b656e64a463756461a86d616e6966657374d940616261626162616261626162616261626162616261626162"
    "61626162616261626162616261626162616261626162616261626162616261626162616261626162a966645f736f636b"
    "6574b42f746d702f747261792f72616e6b2d312e666473a7627566666572739284a46e616d65a26b76a66e6279746573"
    "cd1000a668616e646c65a6666162726963a6666162726963c440000102030405060708090a0b0c0d0e0f101112131415"
    "161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f84a46e616d65"
    "a5666c616773a66e627974657340a668616e646c65a5706f736978a6666162726963c0a667726f75707381a27470c480"
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f"
    "303132333435363738393a3b3c3d3e3f404142434445464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e5f"
    "606162636465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7fa774696d696e677382a5616c6c6f63cb"
    "4000000000000000a6696d706f7274cb3fe0000000000000ad6d616e69666573745f70617468ab2f7372762f6d2e6a73"
    "6f6e"
)
GOLDEN_HEARTBEAT = Heartbeat(token="tok-golden", rank=3, phase="connect", seq=7)
GOLDEN_HEARTBEAT_HEX = (
    "86a46b696e64a9686561727462656174a17608a5746f6b656eaa746f6b2d676f6c64656ea472616e6b03a57068617365"
    "a7636f6e6e656374a373657107"
)


@pytest.mark.parametrize(
    ("msg", "golden"),
    [(GOLDEN_OFFER, GOLDEN_OFFER_HEX), (GOLDEN_HEARTBEAT, GOLDEN_HEARTBEAT_HEX)],
    ids=["offer", "heartbeat"],
)
def test_golden_bytes(msg: Message, golden: str) -> None:
    assert encode(msg).hex() == golden
    assert decode(bytes.fromhex(golden), token="tok-golden") == msg


# --- refusals ---------------------------------------------------------------------------------------


def test_wrong_token_is_refused_without_echoing_either_token() -> None:
    err = _refused(encode(SAMPLES[7]), "wrong token", token="another-token")
    assert TOKEN not in str(err) and "another-token" not in str(err)
    _refused(_raw({**_body(SAMPLES[7]), "token": 7}), "field 'token': expected str, got int")
    body = _body(SAMPLES[7])
    del body["token"]
    _refused(_raw(body), "missing field 'token'")


@pytest.mark.parametrize("other", [TOKEN[:-1] + "X", TOKEN + "X", TOKEN[:-1], TOKEN[:8], ""],
                         ids=["last-char", "longer", "shorter", "prefix", "empty"])
def test_a_token_that_differs_anywhere_is_refused(other: str) -> None:
    """The whole token is compared: one that shares a prefix with the tray's, or extends it, is another tray's."""
    _refused(_raw({**_body(SAMPLES[7]), "token": other}), "wrong token")


def test_wrong_version_says_who_must_upgrade() -> None:
    newer = _raw({**_body(SAMPLES[8]), "v": PROTOCOL_VERSION + 1})
    _refused(newer, f"protocol version {PROTOCOL_VERSION + 1}, expected {PROTOCOL_VERSION}; upgrade tray")
    older = _raw({**_body(SAMPLES[8]), "v": 0})
    _refused(older, "upgrade tray on rank-2", sender="rank-2")
    _refused(_raw({**_body(SAMPLES[8]), "v": "1"}), "field 'v': expected int, got str")
    body = _body(SAMPLES[8])
    del body["v"]
    _refused(_raw(body), "missing field 'v'")


def test_version_1_offer_with_nccl_ids_is_refused() -> None:
    """Version 2 replaced the offer's `nccl` ids with opaque `groups` join info."""
    body = _body(SAMPLES[0])
    body["nccl"] = body.pop("groups")
    _refused(_raw({**body, "v": 1}), f"protocol version 1, expected {PROTOCOL_VERSION}; upgrade tray")
    _refused(_raw(body), "unknown field 'nccl'")


def test_unknown_or_missing_kind() -> None:
    _refused(_raw({**_body(SAMPLES[8]), "kind": "nope"}), "unknown kind 'nope'")
    _refused(_raw({**_body(SAMPLES[8]), "kind": 3}), "unknown kind 3")
    body = _body(SAMPLES[8])
    del body["kind"]
    _refused(_raw(body), "missing field 'kind'")


def test_unknown_field() -> None:
    _refused(_raw({**_body(SAMPLES[7]), "extra": 1}), "unknown field 'extra'")
    body = _body(SAMPLES[0])
    body["device"]["serial"] = "x"
    _refused(_raw(body), "unknown field 'device.serial'")


def test_a_body_with_exactly_a_votes_field_names_is_still_checked_field_by_field() -> None:
    """The fields' names are checked in one test when they are exactly the message's (every valid message): that
    test must not stand for the fields' values, the token, nor a name swapped for another of the same count."""
    vote = SAMPLES[9]
    assert decode(encode(vote), token=TOKEN) == vote == decode(encode(vote), token=TOKEN)  # the same bytes twice
    _refused(_raw({**_body(vote), "token": "another-token"}), "wrong token")
    _refused(_raw({**_body(vote), "rank": "1"}), "field 'rank': expected int, got str")
    _refused(_raw({**_body(vote), "round": -1}), "field 'round': expected int >= 0, got -1")
    _refused(_raw({**_body(vote), "wait_s": float("nan")}), "field 'wait_s': expected a finite float")
    body = _body(vote)
    body["rnd"] = body.pop("round")
    _refused(_raw(body), "unknown field 'rnd'")


def test_missing_field() -> None:
    body = _body(SAMPLES[7])
    del body["seq"]
    _refused(_raw(body), "missing field 'seq'")
    body = _body(SAMPLES[0])
    del body["buffers"][1]["fabric"]
    _refused(_raw(body), "missing field 'buffers[1].fabric'")


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("rank", "3", "field 'rank': expected int, got str"),
        ("rank", True, "field 'rank': expected int, got bool"),
        ("rank", 1.0, "field 'rank': expected int, got float"),
        ("rank", -1, "field 'rank': expected int >= 0, got -1"),
        ("rank", 4, "field 'rank': expected int < world_size 4, got 4"),
        ("world_size", 0, "field 'world_size': expected int >= 1, got 0"),
        ("pid", 0, "field 'pid': expected int >= 1"),
        ("host", b"boot", "field 'host': expected str, got bytes"),
        ("backend", "rocm", "field 'backend': expected one of cuda, host, got 'rocm'"),
        ("buffers", {}, "field 'buffers': expected list, got map"),
        ("device", [], "field 'device': expected map, got list"),
        ("timings", {"import": "fast"}, "field 'timings['import']': expected float, got str"),
        ("timings", {"import": float("inf")}, "expected a finite float"),
        ("groups", {b"tp": bytes(128)}, "field 'groups': expected str keys, got bytes"),
        ("groups", {"tp": bytes(4097)}, "field 'groups['tp']': expected at most 4096 bytes, got 4097 bytes"),
        ("groups", {"tp": "x" * 128}, "field 'groups['tp']': expected at most 4096 bytes, got str"),
        ("groups", [], "field 'groups': expected map, got list"),
        ("manifest", MANIFEST.upper(), "field 'manifest': expected 64 lowercase hex chars"),
        ("manifest", MANIFEST[:-1], "field 'manifest': expected 64 lowercase hex chars"),
    ],
)
def test_wrong_field_in_offer(field: str, value: object, reason: str) -> None:
    _refused(_raw({**_body(SAMPLES[0]), field: value}), reason)


def test_buffer_handles() -> None:
    body = _body(SAMPLES[0])
    body["buffers"][0]["fabric"] = bytes(63)
    _refused(_raw(body), "field 'buffers[0].fabric': expected 64 bytes, got 63 bytes")
    body["buffers"][0]["fabric"] = None
    _refused(_raw(body), "field 'buffers[0].fabric': expected 64 bytes, got None")
    body = _body(SAMPLES[0])
    body["buffers"][1]["fabric"] = bytes(64)
    _refused(_raw(body), "field 'buffers[1].fabric': expected None for a memfd handle, got bytes")
    body["buffers"][1] = {**body["buffers"][1], "handle": "cuda_ipc", "fabric": None}
    _refused(_raw(body), "field 'buffers[1].handle': expected one of fabric, posix, memfd")
    body = _body(SAMPLES[0])
    body["device"]["numa_node"] = -2
    _refused(_raw(body), "field 'device.numa_node': expected int >= -1, got -2")


def test_table_paths_and_nested_tokens() -> None:
    body = _body(SAMPLES[2])
    body["offers"][2]["device"]["ordinal"] = "2"
    _refused(_raw(body), "field 'offers[2].device.ordinal': expected int, got str")
    body = _body(SAMPLES[2])
    body["offers"][1]["token"] = TOKEN
    _refused(_raw(body), "field 'offers[1].token': nested offers carry no token")
    body["offers"][1] = 5
    _refused(_raw(body), "field 'offers[1]': expected map, got int")


def test_a_message_with_an_entry_per_rank_may_take_4_kib_a_rank_past_256_ranks() -> None:
    """Up to 256 ranks every message keeps the 1 MiB limit (and a vote its share of it); past that, a table or a
    decision may take 4 KiB per rank, and a vote about 4 KiB."""
    from tray.handshake.wire import job_message_limit, vote_limit_nbytes

    assert [job_message_limit(w) for w in (1, 8, 256)] == [MAX_MESSAGE_NBYTES] * 3
    assert job_message_limit(257) == 257 * 4096 and job_message_limit(4000) == 4000 * 4096
    assert vote_limit_nbytes(8) == (MAX_MESSAGE_NBYTES - 64) // 8
    assert vote_limit_nbytes(4000) == 4095
    big = Decision(token=TOKEN, topic="t", round=1, values=("v" * 3000,) * 400)
    with pytest.raises(WireError, match="exceeds the limit of 1048576 bytes"):
        encode(big)
    data = encode(big, job_message_limit(400))
    assert decode(data, token=TOKEN, limit=job_message_limit(400)) == big
    _refused(data, f"message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_NBYTES} bytes")


def test_size_and_framing() -> None:
    _refused(b"\x00" * (MAX_MESSAGE_NBYTES + 1), f"exceeds the limit of {MAX_MESSAGE_NBYTES} bytes")
    _refused(_raw([1, 2, 3]), "expected a map at top level, got list")
    _refused(_raw("offer"), "expected a map at top level, got str")
    _refused(b"\xc1", "not valid msgpack")
    _refused(b"", "not valid msgpack")
    _refused(encode(SAMPLES[0])[:-3], "not valid msgpack")
    _refused(encode(SAMPLES[7]) + b"\x00", "not valid msgpack")  # trailing bytes
    _refused(b"\x91" * 5000, "not valid msgpack")  # deeper than msgpack's own stack
    _refused(_raw({1: 2}), "not valid msgpack")  # int map keys
    _refused(_raw({**_body(SAMPLES[7]), "phase": b"\xff\xfe"}), "field 'phase': expected str, got bytes")
    _refused(b"\xa2\xff\xfe", "not valid msgpack")  # a str that is not UTF-8
    with pytest.raises(WireError, match="expected bytes, got str"):
        decode("text", token=TOKEN)  # type: ignore[arg-type]


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def test_vote_value_depth_and_types() -> None:
    ok = {**_body(SAMPLES[10]), "value": _nested(8)}
    assert decode(_raw(ok), token=TOKEN) == Vote(token=TOKEN, rank=0, topic="x", round=0, value=_nested(8))
    _refused(_raw({**ok, "value": _nested(9)}), "nested deeper than 8 levels")
    _refused(_raw({**ok, "value": {"a": {b"k": 1}}}), "field 'value['a']': expected str keys, got bytes")
    ext = msgpack.ExtType(1, b"x")
    _refused(_raw({**ok, "value": [ext]}), "field 'value[0]': expected None, bool, int, float, str, bytes")
    dec = {**_body(SAMPLES[11]), "values": [1, _nested(9)]}
    _refused(_raw(dec), "field 'values[1]")


def test_sender_is_named() -> None:
    err = _refused(b"garbage!", "not valid msgpack", sender="rank-5")
    assert err.sender == "rank-5"
    assert "rank-5" in str(err)
    err = _refused(_raw({**_body(SAMPLES[7]), "rank": "0"}), "heartbeat: field 'rank'", sender="rank-0")
    assert str(err).startswith("message from rank-0: heartbeat: field 'rank': expected int, got str")


def test_encode_refuses_what_decode_would_refuse() -> None:
    with pytest.raises(WireError, match="cannot encode heartbeat: field 'rank': expected int >= 0, got -1"):
        encode(Heartbeat(token=TOKEN, rank=-1, phase="x", seq=0))
    with pytest.raises(WireError, match="cannot encode offer: field 'buffers\\[0\\].fabric'"):
        encode(dataclasses.replace(_offer(), buffers=(BufferOffer("kv", 64, "fabric", None),)))
    with pytest.raises(WireError, match="exceeds the limit"):
        encode(Vote(token=TOKEN, rank=0, topic="t", round=0, value=bytes(MAX_MESSAGE_NBYTES)))
    with pytest.raises(WireError, match="nested deeper than 8"):
        encode(Vote(token=TOKEN, rank=0, topic="t", round=0, value=_nested(9)))
    with pytest.raises(WireError, match="offers\\[1\\].token': differs from the table's token"):
        encode(Table(token=TOKEN, offers=(_offer(0), _offer(1, token="other"))))
    with pytest.raises(WireError, match="cannot encode ready"):
        encode(Ready(token=TOKEN, rank=0, timings={1: 2.0}))  # type: ignore[dict-item]


# --- fuzzing ----------------------------------------------------------------------------------------

ENCODINGS = [encode(m) for m in SAMPLES]
FIELD_NAMES = sorted({f.name for cls in KINDS.values() for f in dataclasses.fields(cls)} | {"kind", "v"})

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=140),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=24,
)


def _outcome(data: bytes) -> None:
    """decode() either refuses with WireError or returns a message that encodes back stably."""
    try:
        msg = decode(data, token=TOKEN, sender="fuzz")
    except WireError as e:
        assert e.sender == "fuzz"
        return
    assert isinstance(msg, tuple(KINDS.values()))
    again = encode(msg)
    assert encode(decode(again, token=TOKEN)) == again


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    _outcome(data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_mutated_encodings(data: st.DataObject) -> None:
    blob = bytearray(data.draw(st.sampled_from(ENCODINGS)))
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        at = data.draw(st.integers(min_value=0, max_value=max(len(blob) - 1, 0)))
        if op == "flip" and blob:
            blob[at] ^= data.draw(st.integers(min_value=1, max_value=255))
        elif op == "insert":
            blob.insert(at, data.draw(st.integers(min_value=0, max_value=255)))
        elif blob:
            del blob[at]
    _outcome(bytes(blob))


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(sorted(KINDS)) | st.text(max_size=10),
    version=st.sampled_from([PROTOCOL_VERSION] * 4 + [0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, "2", None]),
    token=st.sampled_from([TOKEN, TOKEN, "other", 5]),
    fields=st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8), msgpack_values, max_size=8),
)
def test_fuzz_random_bodies(kind: object, version: object, token: object, fields: dict[str, Any]) -> None:
    _outcome(_raw({**fields, "kind": kind, "v": version, "token": token}))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_valid_bodies_with_a_field_changed(data: st.DataObject) -> None:
    body = _body(data.draw(st.sampled_from(SAMPLES)))
    target = body
    if "offers" in body and body["offers"] and data.draw(st.booleans()):
        target = body["offers"][0]
    key = data.draw(st.sampled_from(sorted(target)) | st.sampled_from(FIELD_NAMES))
    if data.draw(st.booleans()) and key in target:
        del target[key]
    else:
        target[key] = data.draw(msgpack_values)
    _outcome(_raw(body))


@pytest.mark.parametrize("reply", [{"ok": True}, {"ok": True, "names": "x"}, [1, 2], {"ok": False, "reason": "no"}])
def test_a_malformed_or_refusing_fd_reply_closes_the_fds_it_brought(tmp_path, reply) -> None:
    """An fd socket that sends an fd with a reply of the wrong shape: a HandshakeError naming the owner, and the
    fd received with it closed (a KeyError escaped, and the fd leaked)."""
    import os
    import socket
    import threading

    import msgpack

    from tray.errors import HandshakeError
    from tray.handshake.fdpass import fetch_fds

    path = str(tmp_path / "fake.fds")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    r, w = os.pipe()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            body = msgpack.packb(reply)
            socket.send_fds(conn, [len(body).to_bytes(4, "big") + body], [r])

    t = threading.Thread(target=serve)
    t.start()
    before = set(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(HandshakeError, match="rank 9"):
            fetch_fds(path, "tok", ["x"], "rank 9", 5.0)
        t.join(5)
        extra = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in set(os.listdir("/proc/self/fd")) - before
                 if os.path.exists(f"/proc/self/fd/{fd}")}
        assert not extra, extra  # the received copy of the pipe's end is closed
    finally:
        server.close()
        os.close(r)
        os.close(w)


def test_the_fd_socket_judges_who_asks_before_reading_and_cuts_a_trickling_request(tmp_path, monkeypatch) -> None:
    """A process of this uid that is no member connected and sent its request a byte every 3 s: the socket (one
    connection at a time) read it for as long, and the members waited behind it. Now a non-member is refused
    before anything is read, and a member's request must arrive whole within _REQUEST_WITHIN_S."""
    import os
    import socket
    import struct
    import time

    from tray.handshake import fdpass

    monkeypatch.setattr(fdpass, "_REQUEST_WITHIN_S", 0.3)
    r, w = os.pipe()
    server = fdpass.FdServer(str(tmp_path / "r.fds"), "tok", 0, {"x": r})
    try:
        server.allow({1})  # this process is not a member
        t0 = time.monotonic()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(server.path)
            s.settimeout(3.0)
            reply = s.recv(4096)   # nothing sent: the refusal comes anyway, at once
        assert b"is not a member of the tray table" in reply and time.monotonic() - t0 < 1.0
        server.allow({os.getpid()})
        t0 = time.monotonic()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(server.path)
            s.settimeout(3.0)
            try:
                s.send(struct.pack("!I", 100))   # a member's request of 100 B announced, then sent a byte at a time
                for _ in range(20):
                    s.send(b"\0")
                    time.sleep(0.1)
            except (BrokenPipeError, ConnectionResetError):
                pass
        assert time.monotonic() - t0 < 1.5
        assert server.refusals[-1] == f"pid {os.getpid()}'s request did not arrive whole within 0.3 s"
        got = fdpass.fetch_fds(server.path, "tok", ["x"], "rank 0", 2.0)   # the socket serves on
        assert list(got) == ["x"]
        os.close(got["x"])
    finally:
        server.close()
        os.close(r)
        os.close(w)


def test_a_non_member_whose_request_the_fd_socket_never_read_gets_the_refusal(tmp_path) -> None:
    """The fd socket refuses a non-member before reading its request and closes: the asker's send then failed with
    EPIPE (its request larger than the socket's buffer here; under load, any request) and it said "Broken pipe"
    instead of the refusal waiting in its socket."""
    import os

    from tray.errors import HandshakeError
    from tray.handshake import fdpass

    r, w = os.pipe()
    server = fdpass.FdServer(str(tmp_path / "r.fds"), "tok", 0, {"x": r})
    try:
        server.allow({1})  # this process is not a member
        with pytest.raises(HandshakeError, match="rank 0's fd socket refused: pid .* is not a member of the tray"):
            fdpass.fetch_fds(server.path, "tok", ["x" * 1000] * 4000, "rank 0", 5.0)
    finally:
        server.close()
        os.close(r)
        os.close(w)


def test_fds_a_rank_has_no_room_for_are_said_to_be_its_limit_not_the_senders(tmp_path) -> None:
    """A reply of 16 fds to a process whose open-file limit leaves room for a few: the kernel drops the rest
    (MSG_CTRUNC), and the error names this process's limit; it read "rank 0 sent 4 fds for 16 buffers", blaming
    the sender."""
    import os
    import socket
    import subprocess
    import sys
    import threading

    import msgpack

    path = str(tmp_path / "fake.fds")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    pipes = [os.pipe() for _ in range(8)]
    fds = [fd for pair in pipes for fd in pair]

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            body = msgpack.packb({"ok": True, "names": [f"b{i}" for i in range(len(fds))], "more": False})
            socket.send_fds(conn, [len(body).to_bytes(4, "big") + body], fds)

    t = threading.Thread(target=serve)
    t.start()
    child = f"""
import os, resource
from tray.errors import HandshakeError
from tray.handshake.fdpass import fetch_fds
open_now = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    fetch_fds({path!r}, "tok", ["x"], "rank 0", 5.0)
except HandshakeError as exc:
    print(exc)
"""
    try:
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
        t.join(5)
    finally:
        server.close()
        for fd in fds:
            os.close(fd)
    assert "this rank could not receive rank 0's fds: its open-file limit is" in out.stdout, out.stdout + out.stderr
    assert "raise it (ulimit -n)" in out.stdout


def test_a_rank_with_no_descriptor_free_tells_the_member_that_asks_for_its_fds(tmp_path) -> None:
    """The serving rank has used up its open-file limit: accept() failed (EMFILE), its serving thread ended, and the
    member that asked waited on its connection until its timeout (30 s, every rank in import_peers). The server now
    lets a reserved descriptor go for the moment and refuses, naming its limit."""
    import os
    import subprocess
    import sys
    import time

    from tray.errors import HandshakeError
    from tray.handshake import fdpass

    path = str(tmp_path / "r.fds")
    script = f"""
import os, resource, sys, time
from tray.handshake import fdpass
r, w = os.pipe()
server = fdpass.FdServer({path!r}, "tok", 0, {{"x": r}})
server.allow({{{os.getpid()}}})
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print("full", flush=True)
time.sleep(20)
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "full"
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match="rank 0's fd socket refused: rank 0 has no file descriptor free to "
                                                 "answer with: its open-file limit is [0-9]+"):
            fdpass.fetch_fds(path, "tok", ["x"], "rank 0", 10.0)
        assert time.monotonic() - t0 < 3.0
    finally:
        child.kill()
        child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()


def test_an_fd_socket_closed_before_its_table_arrived_lets_a_waiting_member_go_at_once(tmp_path) -> None:
    """A member asked while the rank had no table yet (its serving thread waits up to 30 s for it), then the rank's
    start-up failed and it closed the socket: close() waited 2 s for that thread and left it running, its reserve
    descriptor open, until the 30 s were up (and the member waiting as long). Now the close ends the wait: the
    member is refused at once, and the thread is gone."""
    import os
    import socket
    import time

    from tray.handshake import fdpass

    r, w = os.pipe()
    server = fdpass.FdServer(str(tmp_path / "r.fds"), "tok", 0, {"x": r})
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(server.path)
            time.sleep(0.3)  # accepted: the serving thread waits for the table
            t0 = time.monotonic()
            server.close()
            took = time.monotonic() - t0
            s.settimeout(3.0)
            reply = s.recv(4096)
        assert took < 1.0, took
        assert not server._thread.is_alive()
        assert b"closed its fd socket before the tray table arrived" in reply, reply
    finally:
        server.close()
        os.close(r)
        os.close(w)
