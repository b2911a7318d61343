"""`tray inspect`: a manifest as human text, resolved at one world size."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from tray.manifest.schema import (
    BufferRef,
    Manifest,
    ResolvedArg,
    ResolvedBarrier,
    ResolvedBuffer,
    ResolvedCollective,
    ResolvedCopy,
    ResolvedGemm,
    ResolvedLaunch,
    ResolvedManifest,
    ResolvedOp,
)

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def human_bytes(nbytes: int) -> str:
    """`512 B`, `64 KiB`, `1.5 MiB`, `112 GiB`: the largest binary unit the size reaches."""
    for unit, scale in _UNITS:
        if nbytes >= scale:
            value = nbytes / scale
            text = f"{value:.0f}" if nbytes % scale == 0 else f"{value:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{nbytes} B"


def format_inspect(manifest: Manifest, world_size: int, overrides: dict[str, int] | None = None,
                   check_bind: CheckBind | None = None) -> str:
    """Every section of `manifest`, resolved for `world_size` ranks, one item per line.

    Raises what Manifest.resolve raises (UsageError, ManifestError).
    """
    r = manifest.resolve(world_size, overrides)
    lines = [
        f"manifest {manifest.name}  ({manifest.path})",
        f"digest   {manifest.digest}",
        f"world    {world_size} rank{'s' if world_size != 1 else ''}",
    ]
    if manifest.description:
        lines.append(f"about    {manifest.description}")
    lines.append("vars     " + (", ".join(f"{k}={v}" for k, v in r.vars.items())))
    lines += _groups(r)
    lines += _buffers(r)
    lines += _binds(manifest, r, check_bind)
    lines += _states(r)
    lines += _kernels(manifest)
    lines += _programs(r)
    return "\n".join(lines) + "\n"


def _groups(r: ResolvedManifest) -> list[str]:
    lines = ["groups"]
    for name, instances in r.groups.items():
        sizes = sorted({len(i) for i in instances})
        size = "/".join(map(str, sizes))
        shown = " ".join("[" + ",".join(map(str, i)) + "]" for i in instances)
        plural = "s" if len(instances) != 1 else ""
        lines.append(f"  {name:<12} {len(instances)} instance{plural} of {size}: {shown}")
    flags = ", ".join(
        f"{name}: " + " ".join(f"u64[{len(i)}]" for i in instances) for name, instances in r.groups.items()
    )
    lines.append(f"  barrier flags: u64[G] per group instance, implicit, exported ({flags})")
    return lines


def _buffers(r: ResolvedManifest) -> list[str]:
    lines = ["buffers" + ("" if r.buffers else "  (none)")]
    for b in r.buffers:
        shape = ", ".join(map(str, b.shape))
        export = f"export group={b.group}" if b.export else "local"
        bind = "  bind" if b.bind else ""
        lines.append(f"  {b.name:<12} {b.dtype}[{shape}]  {human_bytes(b.nbytes)}  {export}{bind}")
    if r.buffers:
        lines.append(f"  total        {human_bytes(sum(b.nbytes for b in r.buffers))} per rank")
    return lines


# check_bind(buffer, env, json_path, manifest_path): raises where the file's header does not hold what the buffer's
# bind names (tray.weights.loader.check_bind, which the CLI passes: weights sit above the manifest layer)
CheckBind = Callable[[ResolvedBuffer, dict[str, int], str, str], None]


def _binds(m: Manifest, r: ResolvedManifest, check_bind: CheckBind | None) -> list[str]:
    """Per bound buffer and rank, the tensors `rank.load_weights()` will read (tray/weights/bind.py), checked by
    `check_bind` against the file's header where the file is here: a bind's mistakes (a key, a placeholder, a range,
    a tensor the file lacks, its dtype or shape) show up now, not first in a running tray. Raises ManifestError, or
    what `check_bind` raises."""
    bound = [(i, b) for i, b in enumerate(r.buffers) if b.bind]  # as the loader: {} binds nothing
    if not bound:
        return []
    from tray.weights.bind import resolve_bind

    lines = ["binds"]
    for i, b in bound:
        jp = f"$.buffers[{i}].bind"
        assert b.bind is not None
        for rank in range(r.world_size):
            instance = next((inst for inst in r.groups[b.group] if rank in inst), None)
            env = {**r.vars, "rank": rank}
            if instance is not None:  # a rank in no instance of the buffer's group has the buffer, but no index
                env["index"] = instance.index(rank)
            bound_here = resolve_bind(b.bind, env, m.path, jp, b.group)
            names, file = bound_here.tensors, bound_here.file
            if check_bind is None:
                seen = ""
            elif os.path.isfile(file):
                check_bind(b, env, jp, m.path)
                seen = " (checked)"
            elif os.path.exists(file):
                seen = " (not checked: not a regular file)"
            else:
                seen = " (not checked: no such file here)"
            shown = ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ..., {names[-1]}"
            lines.append(f"  {b.name:<12} rank {rank}: {len(names)} tensor{'s' if len(names) != 1 else ''} "
                         f"[{shown}] from {file}{seen}")
    return lines


def _states(r: ResolvedManifest) -> list[str]:
    lines = ["states" + ("" if r.states else "  (none)")]
    for s in r.states:
        lines.append(
            f"  {s.name:<12} {s.pages} pages x {human_bytes(s.page_nbytes)} = {human_bytes(s.nbytes)}"
            f"  host tier {s.host_pages} pages = {human_bytes(s.host_nbytes)}"
        )
    return lines


def _kernels(m: Manifest) -> list[str]:
    lines = ["kernels" + ("" if m.kernels else "  (none)")]
    for k in m.kernels:
        extra = "  peers" if k.peers else ""
        options = f"  options {' '.join(k.options)}" if k.options else ""
        lines.append(f"  {k.name:<12} entry {k.entry}  source {k.source}{extra}{options}")
    return lines


def _programs(r: ResolvedManifest) -> list[str]:
    lines = ["programs" + ("" if r.programs else "  (none)")]
    for p in r.programs.values():
        count = len(p.ops)
        lines.append(f"  {p.name:<12} {count} op{'s' if count != 1 else ''}, graph={str(p.graph).lower()}")
        lines += [f"    {i:>3} {summarize_op(op)}" for i, op in enumerate(p.ops)]
    return lines


def summarize_op(op: ResolvedOp) -> str:
    """One line for a resolved op, e.g. `nccl allreduce group=tp send=x recv=y count=1024 bf16`."""
    match op:
        case ResolvedLaunch():
            args = ", ".join(_arg(a) for a in op.args)
            return (
                f"launch {op.kernel} grid={_dim3(op.grid)} block={_dim3(op.block)}"
                f" shmem={op.shmem} args=[{args}]"
            )
        case ResolvedCollective():
            peer = f" peer={op.peer}" if op.peer is not None else ""
            across = f" across={op.across}" if op.across else ""
            return (
                f"nccl {op.collective} group={op.group} send={_ref(op.send)} recv={_ref(op.recv)}"
                f" count={op.count} {op.dtype}{peer}{across}"
            )
        case ResolvedGemm():
            acc = " +=" if op.accumulate else " ="
            return (
                f"gemm {_ref(op.c)}{acc} {_ref(op.a)} @ {_ref(op.b)}"
                f"  m={op.m} n={op.n} k={op.k} {op.dtype}"
            )
        case ResolvedBarrier():
            return f"barrier {op.group}"
        case ResolvedCopy():
            return f"copy {_ref(op.src)} -> {_ref(op.dst)}  {human_bytes(op.nbytes)}"


def _dim3(dims: Any) -> str:
    return "(" + ",".join(map(str, dims)) + ")"


def _ref(ref: BufferRef) -> str:
    return f"{ref.name}@{ref.offset}" if ref.offset else ref.name


def _arg(arg: ResolvedArg) -> str:
    if arg.kind == "buffer":
        return f"{arg.name}@{arg.offset}" if arg.offset else str(arg.name)
    if arg.kind == "peers":
        return f"peers:{arg.name}"
    if arg.kind == "rank":
        return "rank"
    if arg.kind == "index":
        return f"index:{arg.name}"
    if arg.name is not None:
        return f"{arg.name}={arg.value}"
    return repr(arg.value)
