"""Fill bound buffers from safetensors files: plan every byte, then stream them through two pinned buffers.

Planning reads only headers and checks every name, dtype and shape before one byte moves, so a bad
checkpoint fails fast with the file and tensor named. Loading `os.preadv`s file bytes into one pinned
staging buffer while the previous one is copied to the device on the backend's transfer stream
(`backend.copy(..., transfer=True)`, then `sync_transfer()` before that buffer is refilled).
"""

from __future__ import annotations

import ctypes
import difflib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tray.rank.wiring import RankContext
from tray.weights.bind import ResolvedBind, resolve_bind
from tray.weights.safetensors import DTYPES, CheckpointError, SafetensorsHeader, read_header


class _HasContext(Protocol):
    """A tray.Rank, as far as loading weights goes."""

    def context(self) -> RankContext: ...

# NOTE: 64 MiB per staging buffer keeps a PCIe Gen5 link busy (one copy ~1.2 ms) while the next read
# runs, at a pinned footprint (2 x 64 MiB) that any host can spare.
DEFAULT_STAGING_NBYTES = 64 << 20
PROGRESS_MIN_NBYTES = 1 << 30
PROGRESS_EVERY_S = 2.0


@dataclass(frozen=True)
class BindTarget:
    """A buffer to fill: where it lives, what it is, and its bind with the names its expressions see."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    ptr: int
    bind: dict[str, Any]
    env: dict[str, int]
    json_path: str
    group: str = "world"  # the buffer's group: `index` (in env) is this rank's place in it, absent outside it


@dataclass(frozen=True)
class Piece:
    """`nbytes` at `offset` of `path` go to device address `dst`."""

    path: str
    offset: int
    nbytes: int
    dst: int


@dataclass
class WeightsReport:
    """What a load did: bytes, tensors, seconds and GB/s, per buffer and in total."""

    nbytes: int = 0
    tensors: int = 0
    seconds: float = 0.0
    buffers: dict[str, int] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def plan_target(target: BindTarget, manifest_path: str, headers: dict[str, SafetensorsHeader]) -> list[Piece]:
    """The pieces that fill `target`, after checking names, dtypes, shapes and the total size.

    Raises ManifestError (bad bind) or CheckpointError naming the file, the tensor and the buffer.
    """
    bound: ResolvedBind = resolve_bind(target.bind, target.env, manifest_path, target.json_path, target.group)
    header = headers.get(bound.file)
    if header is None:
        header = headers[bound.file] = read_header(bound.file)
    what = f"buffer {target.name!r} ({target.dtype}{list(target.shape)})"
    pieces: list[Piece] = []
    offset = 0
    for name in bound.tensors:
        t = header.tensors.get(name)
        if t is None:
            close = difflib.get_close_matches(name, list(header.tensors), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise CheckpointError(
                f"{bound.file}: no tensor {name!r} (wanted by {what}); the file holds "
                f"{len(header.tensors)} tensors{hint}"
            )
        if not t.manifest_dtype:
            raise CheckpointError(
                f"{bound.file}: tensor {name!r} is {t.dtype}, a dtype tray does not load (supported: "
                f"{', '.join(DTYPES)}); {what} is {target.dtype}: convert the checkpoint or bind another tensor"
            )
        if t.manifest_dtype != target.dtype:
            raise CheckpointError(
                f"{bound.file}: tensor {name!r} is {t.dtype} ({t.manifest_dtype}); {what} is "
                f"{target.dtype}: convert the checkpoint or change the buffer's dtype"
            )
        trailing = t.shape[1:]
        if len(t.shape) > len(target.shape) or (
            trailing and tuple(target.shape[-len(trailing) :]) != trailing
        ):
            want = list(target.shape[len(target.shape) - len(trailing) :]) if trailing else []
            raise CheckpointError(
                f"{bound.file}: tensor {name!r} has shape {list(t.shape)}; {what} takes "
                f"tensors concatenated along dim 0 with trailing dims {want}"
            )
        if len(t.shape) <= 1 < len(target.shape) and math.prod(target.shape[:-1]) > 1:
            # fewer dims than a buffer of several rows: whole rows only (a buffer of one row, [1, n], takes any split)
            row = target.shape[-1]
            row_nbytes = target.nbytes // math.prod(target.shape[:-1])
            if row_nbytes and (t.nbytes % row_nbytes or offset % row_nbytes):
                raise CheckpointError(
                    f"{bound.file}: tensor {name!r} has shape {list(t.shape)}; {what} takes a tensor of "
                    f"fewer dims only as whole rows of {row} values: bind tensors of shape [n, {row}] or [{row}]"
                )
        if offset + t.nbytes > target.nbytes:
            raise CheckpointError(
                f"{bound.file}: tensor {name!r} {list(t.shape)} overflows {what}: the bound "
                f"tensors hold more than its {target.nbytes} B"
            )
        if t.nbytes:
            pieces.append(Piece(bound.file, t.offset, t.nbytes, target.ptr + offset))
        offset += t.nbytes
    if offset != target.nbytes:
        raise CheckpointError(
            f"{bound.file}: the {len(bound.tensors)} tensors bound to {what} hold {offset} B; "
            f"the buffer holds {target.nbytes} B"
        )
    return _merge(pieces)


def check_bind(buffer: Any, env: dict[str, int], json_path: str, manifest_path: str,
               headers: dict[str, SafetensorsHeader] | None = None) -> None:
    """What `plan_target` checks for a resolved buffer (`.name`, `.dtype`, `.shape`, `.nbytes`, `.bind`) of the rank
    whose names `env` holds, from the file's header only (nothing is read or written): `tray inspect` uses it.
    Raises ManifestError or CheckpointError (naming that rank)."""
    target = BindTarget(buffer.name, buffer.dtype, tuple(buffer.shape), buffer.nbytes, 0, buffer.bind, env, json_path,
                        buffer.group)
    try:
        plan_target(target, manifest_path, {} if headers is None else headers)
    except CheckpointError as exc:
        raise CheckpointError(f"rank {env.get('rank')} of {env.get('world_size')}: {exc}") from None


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Fold pieces contiguous in the file and on the device into one (fewer reads and copies)."""
    out: list[Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if (
            last
            and last.path == p.path
            and last.offset + last.nbytes == p.offset
            and last.dst + last.nbytes == p.dst
        ):
            out[-1] = Piece(p.path, last.offset, last.nbytes + p.nbytes, last.dst)
        else:
            out.append(p)
    return out


@dataclass(frozen=True)
class _Segment:
    path: str
    offset: int
    nbytes: int
    dst: int
    stage_offset: int


def _batches(pieces: Sequence[Piece], stage_nbytes: int) -> Iterator[list[_Segment]]:
    """Pieces cut and packed into staging-buffer-sized batches."""
    batch: list[_Segment] = []
    used = 0
    for p in pieces:
        done = 0
        while done < p.nbytes:
            n = min(p.nbytes - done, stage_nbytes - used)
            batch.append(_Segment(p.path, p.offset + done, n, p.dst + done, used))
            used += n
            done += n
            if used == stage_nbytes:
                yield batch
                batch, used = [], 0
    if batch:
        yield batch


def _read_into(fd: int, path: str, offset: int, nbytes: int, ptr: int) -> None:
    view = memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise CheckpointError(
                f"{path}: unexpected end of file at byte {offset + done} (wanted {nbytes} B "
                f"from {offset}): the file is truncated"
            )
        done += got


def copy_pieces(
    backend: Any,
    pieces: Sequence[Piece],
    staging_nbytes: int = DEFAULT_STAGING_NBYTES,
    progress: Callable[[int, int, float], None] | None = None,
) -> float:
    """Stream `pieces` to the device through two pinned buffers; returns the seconds it took.

    `progress(done_nbytes, total_nbytes, seconds)` is called after every batch.
    """
    total = sum(p.nbytes for p in pieces)
    if total == 0:
        return 0.0
    stage_nbytes = min(staging_nbytes, total)
    stages = []
    fds: dict[str, int] = {}
    t0 = time.perf_counter()
    try:
        stages = [backend.pinned_host(stage_nbytes), backend.pinned_host(stage_nbytes)]
        done = 0
        for i, batch in enumerate(_batches(pieces, stage_nbytes)):
            stage = stages[i % 2]
            for s in batch:  # overlaps the copy of the previous batch, from the other stage
                fd = fds.get(s.path)
                if fd is None:
                    fd = fds[s.path] = os.open(s.path, os.O_RDONLY | os.O_CLOEXEC)
                _read_into(fd, s.path, s.offset, s.nbytes, stage.ptr + s.stage_offset)
            backend.sync_transfer()  # the previous batch landed: its stage is free for the next one
            for s in batch:
                backend.copy(s.dst, stage.ptr + s.stage_offset, s.nbytes, transfer=True)
            done += sum(s.nbytes for s in batch)
            if progress is not None:
                progress(done, total, time.perf_counter() - t0)
        backend.sync_transfer()
        return time.perf_counter() - t0
    finally:
        backend.sync_transfer()
        for fd in fds.values():
            os.close(fd)
        for stage in stages:
            backend.free(stage)  # not only closed: the backend would hold it until its own close


def load_targets(
    backend: Any,
    targets: Sequence[BindTarget],
    manifest_path: str,
    *,
    who: str = "",
    staging_nbytes: int = DEFAULT_STAGING_NBYTES,
    progress: bool = True,
) -> WeightsReport:
    """Plan every target (all checks first), then load them. Prints a progress line for loads > 1 GiB."""
    headers: dict[str, SafetensorsHeader] = {}
    report = WeightsReport()
    pieces: list[Piece] = []
    for t in targets:
        planned = plan_target(t, manifest_path, headers)
        report.buffers[t.name] = t.nbytes
        report.tensors += len(resolve_bind(t.bind, t.env, manifest_path, t.json_path, t.group).tensors)
        pieces += planned
    report.nbytes = sum(p.nbytes for p in pieces)
    show = progress and report.nbytes > PROGRESS_MIN_NBYTES
    last = [0.0]

    def line(done: int, total: int, seconds: float) -> None:
        if seconds - last[0] >= PROGRESS_EVERY_S or done == total:
            last[0] = seconds
            print(
                f"weights{who}: {done / 2**30:.1f}/{total / 2**30:.1f} GiB ({100 * done // total}%), "
                f"{done / max(seconds, 1e-9) / 1e9:.1f} GB/s",
                file=sys.stderr,
                flush=True,
            )

    report.seconds = copy_pieces(backend, pieces, staging_nbytes, line if show else None)
    if show:
        print(
            f"weights{who}: {report.tensors} tensors into {len(targets)} buffers, "
            f"{report.nbytes / 2**30:.2f} GiB in {report.seconds:.2f} s ({report.gbps:.1f} GB/s)",
            file=sys.stderr,
            flush=True,
        )
    return report


def rank_targets(ctx: RankContext) -> list[BindTarget]:
    """The bound buffers of a rank, with the names their bind expressions see."""
    targets = []
    names = [b.name for b in ctx.manifest.buffers]
    for b in ctx.resolved.buffers:
        if not b.bind:
            continue
        env = dict(ctx.resolved.vars)
        env["rank"] = ctx.rank
        if b.group in ctx.wiring.groups:  # a rank in no instance of the group has the buffer but no index in it
            env["index"] = ctx.wiring.group(b.group).index
        buf = ctx.wiring.buffer(b.name)
        targets.append(
            BindTarget(
                b.name,
                b.dtype,
                tuple(b.shape),
                b.nbytes,
                buf.ptr,
                b.bind,
                env,
                f"$.buffers[{names.index(b.name)}].bind",
                b.group,
            )
        )
    return targets


def load_weights(
    rank: _HasContext | RankContext, *, staging_nbytes: int = DEFAULT_STAGING_NBYTES, progress: bool = True
) -> WeightsReport:
    """Fill every buffer of `rank` (a tray.Rank, or its context) whose manifest entry has a `bind`
    (see tray/weights/bind.py).

    Synchronous: returns when every byte landed on the device. Raises ManifestError for a bad bind,
    CheckpointError for a missing file or tensor, a wrong dtype or shape, or a truncated file.
    """
    ctx = rank if isinstance(rank, RankContext) else rank.context()
    return load_targets(
        ctx.backend,
        rank_targets(ctx),
        ctx.manifest.path,
        who=f" rank {ctx.rank}",
        staging_nbytes=staging_nbytes,
        progress=progress,
    )
