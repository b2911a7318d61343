"""Weights from safetensors into bound buffers (host backend): bytes land exactly, errors name things."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from tray.backend.base import itemsize
from tray.backend.host import HostBackend
from tray.errors import ManifestError
from tray.weights import BindTarget, CheckpointError, load_targets, read_header, resolve_bind
from tray.weights.loader import Piece, copy_pieces

BF16 = np.dtype(ml_dtypes.bfloat16)


def save_bf16(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """bf16 through safetensors' numpy API (ml_dtypes' bfloat16 is written as BF16)."""
    save_file({k: v.astype(BF16) for k, v in tensors.items()}, str(path))


@pytest.fixture
def backend():
    b = HostBackend.open(0)
    yield b
    b.close()


def target(backend, name, dtype, shape, bind, env=None):
    size = int(np.prod(shape)) * itemsize(dtype)
    buf = backend.allocate(name, size, False)
    return BindTarget(
        name,
        dtype,
        tuple(shape),
        size,
        buf.ptr,
        bind,
        dict(env or {"world_size": 1, "rank": 0}),
        "$.buffers[0].bind",
    )


def read(backend, t, dtype):
    return backend.read(t.ptr, t.nbytes).view(dtype).reshape(t.shape)


def test_header_matches_what_safetensors_wrote(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(5, dtype=np.int32)
    save_file({"a": a, "b": b}, str(tmp_path / "m.safetensors"), metadata={"k": "v"})
    h = read_header(str(tmp_path / "m.safetensors"))
    assert set(h.tensors) == {"a", "b"} and h.metadata == {"k": "v"}
    raw = (tmp_path / "m.safetensors").read_bytes()
    ta = h.tensors["a"]
    assert (ta.dtype, ta.shape, ta.nbytes) == ("F32", (3, 4), 48)
    assert raw[ta.offset : ta.offset + ta.nbytes] == a.tobytes()


def test_experts_of_each_rank_concatenate_along_dim0(tmp_path, backend):
    rng = np.random.default_rng(0)
    E, F, H, G = 8, 4, 16, 4
    w = {
        f"experts.{e}.{n}": rng.standard_normal((F, H)).astype(np.float32)
        for e in range(E)
        for n in ("w1", "w3")
    }
    save_bf16(tmp_path / "ckpt.safetensors", w)
    manifest = str(tmp_path / "m.json")
    bind = {
        "file": "ckpt.safetensors",
        "tensors": ["experts.{e}.w1", "experts.{e}.w3"],
        "range": {"e": ["experts // world_size * rank", "experts // world_size"]},
    }
    for r in range(G):
        env = {"experts": E, "world_size": G, "rank": r, "index": r}
        t = target(backend, f"w13_{r}", "bf16", (E // G, 2 * F, H), bind, env)
        report = load_targets(backend, [t], manifest)
        want = np.stack(
            [
                np.concatenate([w[f"experts.{e}.w1"], w[f"experts.{e}.w3"]])
                for e in range(r * E // G, (r + 1) * E // G)
            ]
        ).astype(BF16)
        assert read(backend, t, BF16).tobytes() == want.tobytes()
        assert report.nbytes == t.nbytes and report.tensors == 2 * E // G


@pytest.mark.parametrize("staging", [7, 64, 1000, 1 << 20])
def test_double_buffering_lands_every_byte(tmp_path, staging):
    """Copies complete only at sync_transfer here: refilling a stage before its copy landed would corrupt."""
    rng = np.random.default_rng(1)
    tensors = {
        f"t{i}": rng.integers(0, 255, size=n, dtype=np.uint8) for i, n in enumerate([1, 100, 3, 777, 64, 0])
    }
    save_file(tensors, str(tmp_path / "c.safetensors"))
    h = read_header(str(tmp_path / "c.safetensors"))

    class DeferredCopies(HostBackend):
        def __init__(self):
            super().__init__(0)
            self.pending = []

        def copy(self, dst_ptr, src_ptr, nbytes, *, transfer=False):
            self.pending.append((dst_ptr, src_ptr, nbytes))

        def sync_transfer(self):
            for dst, src, n in self.pending:
                super().copy(dst, src, n)
            self.pending.clear()

    backend = DeferredCopies()
    try:
        total = sum(t.nbytes for t in h.tensors.values())
        dst = backend.allocate("dst", total, False)
        pieces, off = [], 0
        for name in reversed(list(tensors)):  # not file order: pieces are arbitrary
            t = h.tensors[name]
            pieces.append(Piece(h.path, t.offset, t.nbytes, dst.ptr + off))
            off += t.nbytes
        copy_pieces(backend, [p for p in pieces if p.nbytes], staging_nbytes=staging)
        want = b"".join(tensors[n].tobytes() for n in reversed(list(tensors)))
        assert backend.read(dst.ptr, total).tobytes() == want
    finally:
        backend.close()


def test_missing_tensor_names_file_tensor_and_buffer(tmp_path, backend):
    save_file({"layer.w1": np.zeros((2, 2), np.float32)}, str(tmp_path / "c.safetensors"))
    t = target(backend, "w", "f32", (2, 2), {"file": "c.safetensors", "tensors": ["layer.w2"]})
    with pytest.raises(CheckpointError) as err:
        load_targets(backend, [t], str(tmp_path / "m.json"))
    msg = str(err.value)
    assert (
        "c.safetensors" in msg
        and "'layer.w2'" in msg
        and "buffer 'w'" in msg
        and "did you mean 'layer.w1'" in msg
    )


def test_wrong_dtype_names_both(tmp_path, backend):
    save_file({"a": np.zeros((2, 2), np.float16)}, str(tmp_path / "c.safetensors"))
    t = target(backend, "w", "bf16", (2, 2), {"file": "c.safetensors", "tensors": ["a"]})
    with pytest.raises(
        CheckpointError, match=r"c\.safetensors: tensor 'a' is F16 \(f16\); buffer 'w' .* is bf16"
    ):
        load_targets(backend, [t], str(tmp_path / "m.json"))


def test_a_tensor_of_a_dtype_tray_does_not_load_fails_only_the_buffer_that_binds_it(tmp_path, backend):
    """fp8 checkpoints keep bf16/f32 tensors (norms, scales) beside their F8_E4M3 weights: those load."""
    head = json.dumps({"w": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]},
                       "s": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    data = bytes(4) + np.array([1.5, 2.5], np.float32).tobytes()
    (tmp_path / "c.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + data)
    s = target(backend, "s", "f32", (2,), {"file": "c.safetensors", "tensors": ["s"]})
    load_targets(backend, [s], str(tmp_path / "m.json"))
    assert read(backend, s, np.float32).tolist() == [1.5, 2.5]
    w = target(backend, "w", "u8", (4,), {"file": "c.safetensors", "tensors": ["w"]})
    with pytest.raises(CheckpointError, match=r"c\.safetensors: tensor 'w' is F8_E4M3, a dtype tray does not load.*"
                                              r"buffer 'w' \(u8\[4\]\)"):
        load_targets(backend, [w], str(tmp_path / "m.json"))


def test_wrong_shape_and_wrong_total(tmp_path, backend):
    save_file(
        {"a": np.zeros((2, 3), np.float32), "b": np.zeros((2, 4), np.float32)},
        str(tmp_path / "c.safetensors"),
    )
    bad_trailing = target(backend, "w", "f32", (3, 4), {"file": "c.safetensors", "tensors": ["a"]})
    with pytest.raises(
        CheckpointError, match=r"tensor 'a' has shape \[2, 3\]; buffer 'w' .* trailing dims \[4\]"
    ):
        load_targets(backend, [bad_trailing], str(tmp_path / "m.json"))
    short = target(backend, "v", "f32", (3, 4), {"file": "c.safetensors", "tensors": ["b"]})
    with pytest.raises(CheckpointError, match=r"hold 32 B; the buffer holds 48 B"):
        load_targets(backend, [short], str(tmp_path / "m.json"))
    over = target(backend, "u", "f32", (1, 4), {"file": "c.safetensors", "tensors": ["b"]})
    with pytest.raises(CheckpointError, match="overflows buffer 'u'"):
        load_targets(backend, [over], str(tmp_path / "m.json"))


def test_a_tensor_of_fewer_dims_fills_whole_rows_only(tmp_path, backend):
    save_file(
        {"bias0": np.arange(4, dtype=np.float32), "bias1": np.arange(4, 8, dtype=np.float32),
         "flat": np.arange(12, dtype=np.float32), "odd": np.zeros(6, np.float32), "two": np.zeros(2, np.float32)},
        str(tmp_path / "c.safetensors"),
    )
    stacked = target(backend, "b", "f32", (2, 4), {"file": "c.safetensors", "tensors": ["bias0", "bias1"]})
    load_targets(backend, [stacked], str(tmp_path / "m.json"))  # vectors stacked as rows
    assert read(backend, stacked, np.float32).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    rows = target(backend, "f", "f32", (3, 4), {"file": "c.safetensors", "tensors": ["flat"]})
    load_targets(backend, [rows], str(tmp_path / "m.json"))  # a flat tensor of whole rows
    assert read(backend, rows, np.float32).ravel().tolist() == list(range(12))
    one_row = target(backend, "q", "f32", (1, 12), {"file": "c.safetensors", "tensors": ["bias0", "bias1", "bias0"]})
    load_targets(backend, [one_row], str(tmp_path / "m.json"))  # one row of fused pieces (q, k, v biases)
    assert read(backend, one_row, np.float32).ravel().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    for shape, names, bad in (((3, 4), ["odd", "odd"], "odd"), ((2, 4), ["two", "odd"], "two")):
        t = target(backend, "w", "f32", shape, {"file": "c.safetensors", "tensors": names})
        with pytest.raises(CheckpointError, match=rf"tensor '{bad}' has shape \[\d\]; buffer 'w' .* only as whole "
                           r"rows of 4 values: bind tensors of shape \[n, 4\] or \[4\]"):
            load_targets(backend, [t], str(tmp_path / "m.json"))


def test_nothing_moves_when_any_buffer_is_bad(tmp_path, backend):
    save_file({"a": np.ones(4, np.float32)}, str(tmp_path / "c.safetensors"))
    good = target(backend, "good", "f32", (4,), {"file": "c.safetensors", "tensors": ["a"]})
    bad = target(backend, "bad", "f32", (4,), {"file": "c.safetensors", "tensors": ["nope"]})
    with pytest.raises(CheckpointError):
        load_targets(backend, [good, bad], str(tmp_path / "m.json"))
    assert not read(backend, good, np.float32).any()


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda raw: raw[:4], "shorter than the 8-byte header length"),
        (lambda raw: (10**9).to_bytes(8, "little") + raw[8:], "header length 1000000000 B does not fit"),
        (lambda raw: raw[:-3], "truncated or corrupt"),
        (lambda raw: raw[:8] + b"[" + raw[9:], "header is not JSON"),
    ],
)
def test_corrupt_files_are_named(tmp_path, damage, match):
    save_file({"a": np.ones(4, np.float32)}, str(tmp_path / "c.safetensors"))
    path = tmp_path / "c.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match=match) as err:
        read_header(str(path))
    assert str(path) in str(err.value)


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    path = tmp_path / "c.safetensors"
    os.mkfifo(path)
    with pytest.raises(CheckpointError, match="not a regular file") as err:
        read_header(str(path))  # no writer ever comes: opening it for reading must not wait for one
    assert str(path) in str(err.value)


def test_overlapping_tensors_are_named(tmp_path):
    head = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                       "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
                       "e": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}}).encode()
    path = tmp_path / "c.safetensors"
    path.write_bytes(len(head).to_bytes(8, "little") + head + bytes(24))
    with pytest.raises(CheckpointError, match=r"tensors 'a' and 'b' overlap in the data \(bytes 8..15\)"):
        read_header(str(path))


def test_missing_file(tmp_path, backend):
    t = target(backend, "w", "f32", (4,), {"file": "absent.safetensors", "tensors": ["a"]})
    with pytest.raises(CheckpointError, match=r"absent\.safetensors: cannot read"):
        load_targets(backend, [t], str(tmp_path / "m.json"))


@pytest.mark.parametrize(
    "bind, where, match",
    [
        ({"tensors": ["a"]}, "$.buffers[0].bind.file", "expected a path"),
        ({"file": "c", "tensors": []}, "$.buffers[0].bind.tensors", "non-empty list"),
        ({"file": "c", "tensors": ["a"], "extra": 1}, "$.buffers[0].bind", "unknown key"),
        ({"file": "c", "tensors": ["x.{q}"]}, "$.buffers[0].bind.tensors[0]", "{q}"),
        (
            {"file": "c", "tensors": ["a"], "range": {"e": ["nope", 2]}},
            "$.buffers[0].bind.range.e",
            "unknown name",
        ),
        (
            {"file": "c", "tensors": ["a"], "range": {"rank": [0, 2]}},
            "$.buffers[0].bind.range.rank",
            "shadows",
        ),
    ],
)
def test_bad_bind_is_a_manifest_error_with_its_path(tmp_path, bind, where, match):
    with pytest.raises(ManifestError, match=match) as err:
        resolve_bind(bind, {"world_size": 2, "rank": 0}, str(tmp_path / "m.json"), "$.buffers[0].bind")
    assert err.value.json_path == where


def test_bind_paths_and_ranges(tmp_path):
    r = resolve_bind(
        {"file": "sub/c.safetensors", "tensors": ["l{i}.{j}"], "range": {"i": [1, 2], "j": ["rank", 2]}},
        {"world_size": 2, "rank": 1},
        str(tmp_path / "m.json"),
        "$",
    )
    assert r.file == str(tmp_path / "sub" / "c.safetensors")
    assert r.tensors == ("l1.1", "l1.2", "l2.1", "l2.2")
    absolute = resolve_bind({"file": "/abs/c", "tensors": ["a"]}, {}, str(tmp_path / "m.json"), "$")
    assert absolute.file == "/abs/c"


def test_manifest_keeps_bind(tmp_path):
    from tray.manifest import load_manifest

    doc = {
        "format": 1,
        "name": "b",
        "vars": {"n": 4},
        "buffers": [
            {"name": "w", "dtype": "f32", "shape": ["n"], "bind": {"file": "c.safetensors", "tensors": ["a"]}}
        ],
    }
    (tmp_path / "m.json").write_text(json.dumps(doc))
    resolved = load_manifest(tmp_path / "m.json").resolve(2)
    assert resolved.buffer("w").bind == {"file": "c.safetensors", "tensors": ["a"]}


def test_loading_again_and_again_leaves_no_staging_buffers_behind(tmp_path, backend):
    """Each load stages through pinned buffers it frees at its end: the backend must not keep them (nor anything
    else) for its own close, or a rank that reloads weights grows with every load."""
    save_file({"w": np.arange(256, dtype=np.float32)}, str(tmp_path / "w.safetensors"))
    t = target(backend, "w", "f32", (256,), {"file": "w.safetensors", "tensors": ["w"]})
    load_targets(backend, [t], str(tmp_path / "m.json"))
    held = len(backend._owned)
    for _ in range(20):
        load_targets(backend, [t], str(tmp_path / "m.json"))
    assert len(backend._owned) == held
    assert read(backend, t, np.float32).tolist() == list(range(256))


def test_inspect_shows_each_ranks_tensors_and_checks_them_against_the_file(tmp_path):
    """`tray inspect` resolves every rank's bind and checks it against the file's header: a bind mistake is named
    before any tray starts (it passed inspect and launch, and failed first in rank.load_weights())."""
    from tray.manifest import load_manifest
    from tray.manifest.inspect import format_inspect
    from tray.weights.loader import check_bind

    save_file({f"e.{i}": np.full((2, 3), i, np.float32) for i in range(4)}, str(tmp_path / "c.safetensors"))
    doc = {
        "format": 1, "name": "b", "vars": {"experts": 4},
        "buffers": [{"name": "w", "dtype": "f32", "shape": ["experts // world_size * 2", 3],
                     "bind": {"file": "c.safetensors", "tensors": ["e.{i}"],
                              "range": {"i": ["experts // world_size * rank", "experts // world_size"]}}}],
    }
    (tmp_path / "m.json").write_text(json.dumps(doc))
    text = format_inspect(load_manifest(tmp_path / "m.json"), 2, check_bind=check_bind)
    assert f"w            rank 1: 2 tensors [e.2, e.3] from {tmp_path / 'c.safetensors'} (checked)" in text, text
    doc["buffers"][0]["bind"]["range"]["i"][0] = "experts // world_size * rank + 1"  # past the file's last tensor
    (tmp_path / "m.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="rank 1 of 2: .*no tensor 'e.4'"):
        format_inspect(load_manifest(tmp_path / "m.json"), 2, check_bind=check_bind)
    # a directory where the file is named was said to be "no such file here"
    (tmp_path / "c.safetensors").unlink()
    (tmp_path / "c.safetensors").mkdir()
    text = format_inspect(load_manifest(tmp_path / "m.json"), 2, check_bind=check_bind)
    assert f"from {tmp_path / 'c.safetensors'} (not checked: not a regular file)" in text, text
    doc["buffers"][0]["bind"]["tensor"] = doc["buffers"][0]["bind"].pop("tensors")
    (tmp_path / "m.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="unknown key.*tensor.*did you mean 'tensors'") as err:
        format_inspect(load_manifest(tmp_path / "m.json"), 2, check_bind=check_bind)
    assert err.value.json_path == "$.buffers[0].bind"
