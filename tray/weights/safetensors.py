"""The safetensors format, read directly: an 8-byte little-endian header length, a JSON header, the data.

Header entries: `name -> {"dtype": "BF16", "shape": [d0, d1...], "data_offsets": [begin, end]}` with
offsets relative to the first byte after the header; `__metadata__` (str -> str) is optional. Only the
header is parsed here; tensor bytes are read by the loader straight into pinned staging memory.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass

from tray.errors import UsageError

# NOTE: real headers are kilobytes to a few MiB (one entry per tensor); the bound stops a corrupt
# length from making us allocate gigabytes before we can say the file is broken.
MAX_HEADER_NBYTES = 100 << 20

# safetensors dtype -> (manifest dtype, bytes per element); others (F8, BOOL, complex) are refused.
DTYPES: dict[str, tuple[str, int]] = {
    "BF16": ("bf16", 2), "F16": ("f16", 2), "F32": ("f32", 4), "F64": ("f64", 8),
    "I8": ("i8", 1), "U8": ("u8", 1), "I16": ("i16", 2), "U16": ("u16", 2),
    "I32": ("i32", 4), "U32": ("u32", 4), "I64": ("i64", 8), "U64": ("u64", 8),
}  # fmt: skip


class CheckpointError(UsageError):
    """A checkpoint file is missing, malformed, or does not hold what a manifest binds to it."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: `offset` is absolute in the file, `nbytes` = prod(shape) * itemsize."""

    name: str
    dtype: str  # the safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def manifest_dtype(self) -> str:
        """The manifest's name for the dtype; "" for a dtype tray does not load (F8_*, BOOL...)."""
        return DTYPES[self.dtype][0] if self.dtype in DTYPES else ""


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    file_nbytes: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: str) -> SafetensorsHeader:
    """Parse and check the header of `path`. Raises CheckpointError naming the file and the entry."""
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
                    "a device or socket"
                raise CheckpointError(f"{path}: not a safetensors file: it is {kind}, not a regular file")
            file_nbytes = st.st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: not a safetensors file: {len(head)} bytes, shorter than the "
                    "8-byte header length"
                )
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_NBYTES or 8 + n > file_nbytes:
                raise CheckpointError(
                    f"{path}: not a safetensors file: header length {n} B does not fit the "
                    f"file of {file_nbytes} B (or exceeds {MAX_HEADER_NBYTES} B)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint: {exc.strerror or exc}") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: the safetensors header is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    data_start = 8 + n
    data_nbytes = file_nbytes - data_start
    tensors: dict[str, TensorEntry] = {}
    metadata: dict[str, str] = {}
    for name, entry in doc.items():
        if name == "__metadata__":
            if isinstance(entry, dict):
                metadata = {str(k): str(v) for k, v in entry.items()}
            continue
        tensors[name] = _entry(path, name, entry, data_start, data_nbytes)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(
                f"{path}: tensors {a!r} and {b!r} overlap in the data (bytes {begin - data_start}.."
                f"{end - data_start - 1}): the file is corrupt; write it again"
            )
    return SafetensorsHeader(path, file_nbytes, tensors, metadata)


def _entry(path: str, name: str, entry: object, data_start: int, data_nbytes: int) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise CheckpointError(
            f"{where}: expected an object with dtype, shape and data_offsets, got {entry!r:.80}"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: dtype must be a string, got {dtype!r:.80}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise CheckpointError(f"{where}: shape must be a list of non-negative ints, got {shape!r:.80}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise CheckpointError(f"{where}: data_offsets must be [begin, end], got {offsets!r:.80}")
    begin, end = offsets
    # a dtype tray does not load is refused only when a buffer binds the tensor: the file's other tensors load
    nbytes = math.prod(shape) * DTYPES[dtype][1] if dtype in DTYPES else end - begin
    if not 0 <= begin <= end <= data_nbytes or end - begin != nbytes:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] do not hold {dtype}{shape} ({nbytes} B) "
            f"inside the {data_nbytes} B of data: the file is truncated or corrupt"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, nbytes)
