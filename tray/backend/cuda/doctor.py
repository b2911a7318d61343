"""`tray doctor` on the cuda backend: what this host's GPUs are and can do, measured in one process.

Reports every visible GPU, the peer-access matrix, which shareable handle types really work (by
trying them), the driver and NCCL versions, and quick copy bandwidths (pinned host <-> GPU, GPU -> GPU).
Everything it allocates is freed before it returns.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from tray.backend.cuda import driver as drv

COPY_NBYTES = 256 << 20  # NOTE: 256 MiB: well past launch costs, a few ms per copy at PCIe speed
COPY_REPEATS = 5
REPORT_KEYS = ("driver_version", "nccl_version", "gpus", "p2p", "handle_types", "host_copy_gbps",
               "peer_copy_gbps", "host_pool_numa")


@dataclass
class _Gpu:
    ordinal: int
    device: Any
    context: Any


def _numa_node(pci_bus: str) -> int:
    try:
        from tray.numa import gpu_numa_node

        return int(gpu_numa_node(pci_bus))
    except Exception:
        return -1


def _in_context(gpu: _Gpu, fn: Callable[..., None], *args: Any) -> None:
    """Run a release step with its GPU's context current (callbacks of the teardown stack)."""
    drv.ctx_set_current(gpu.context, gpu.ordinal)
    fn(*args)


def _gpu_row(gpu: _Gpu) -> dict[str, Any]:
    dev = gpu.device
    pci_bus = drv.device_pci_bus_id(dev)
    major = drv.device_attribute(dev, "COMPUTE_CAPABILITY_MAJOR")
    minor = drv.device_attribute(dev, "COMPUTE_CAPABILITY_MINOR")
    return {
        "ordinal": gpu.ordinal,
        "name": drv.device_name(dev),
        "uuid": drv.device_uuid(dev),
        "pci_bus": pci_bus,
        "memory_mib": drv.device_total_mem(dev) >> 20,
        "compute_capability": f"{major}.{minor}",
        "numa_node": _numa_node(pci_bus),
    }


def _p2p_row(src: _Gpu, dst: _Gpu) -> dict[str, Any]:
    can = drv.device_can_access_peer(src.device, dst.device)
    return {
        "src": src.ordinal,
        "dst": dst.ordinal,
        "can_access_peer": can,
        "access_supported": bool(drv.device_p2p_attribute("ACCESS_SUPPORTED", src.device, dst.device)),
        "native_atomics": bool(drv.device_p2p_attribute("NATIVE_ATOMIC_SUPPORTED", src.device, dst.device)),
    }


def _try_handle(ordinal: int, bit: int) -> str:
    """'ok' if an allocation exportable as `bit` can be created and exported here, else the error code."""
    try:
        granularity = drv.allocation_granularity(ordinal, bit)
        handle = drv.mem_create(granularity, ordinal, bit)
        try:
            if bit == drv.HANDLE_POSIX:
                os.close(drv.mem_export_posix(handle))
            else:
                drv.mem_export_fabric(handle)
        finally:
            drv.mem_release(handle)
    except drv.CudaError as exc:
        return exc.code
    return "ok"


def _median_copy_gbps(copy: Callable[[Any], None], stream: Any, nbytes: int) -> float:
    """GB/s (1e9 B/s) of the median of COPY_REPEATS timed copies, after one warm-up."""
    start, stop = drv.event_create(), drv.event_create()
    try:
        copy(stream)
        times = []
        for _ in range(COPY_REPEATS):
            drv.event_record(start, stream)
            copy(stream)
            drv.event_record(stop, stream)
            drv.event_synchronize(stop)
            times.append(drv.event_elapsed_ms(start, stop) / 1e3)
        return round(nbytes / statistics.median(times) / 1e9, 1)
    finally:
        drv.event_destroy(start)
        drv.event_destroy(stop)


def _host_copies(gpus: list[_Gpu], device_bufs: dict[int, int], streams: dict[int, Any],
                 host: int) -> list[dict[str, Any]]:
    rows = []
    for gpu in gpus:
        drv.ctx_set_current(gpu.context, gpu.ordinal)
        dptr, stream = device_bufs[gpu.ordinal], streams[gpu.ordinal]
        h2d = _median_copy_gbps(lambda s, d=dptr: drv.memcpy_htod_async(d, host, COPY_NBYTES, s), stream,
                                COPY_NBYTES)
        d2h = _median_copy_gbps(lambda s, d=dptr: drv.memcpy_dtoh_async(host, d, COPY_NBYTES, s), stream,
                                COPY_NBYTES)
        rows.append({"ordinal": gpu.ordinal, "h2d": h2d, "d2h": d2h})
    return rows


def _peer_copies(gpus: list[_Gpu], p2p: list[dict[str, Any]], device_bufs: dict[int, int],
                 streams: dict[int, Any]) -> list[dict[str, Any]]:
    rows = []
    by_ordinal = {g.ordinal: g for g in gpus}
    for link in p2p:
        src, dst = by_ordinal[link["src"]], by_ordinal[link["dst"]]
        gbps = None
        if link["can_access_peer"]:
            drv.ctx_set_current(src.context, src.ordinal)
            drv.ctx_enable_peer_access(dst.context, dst.ordinal)
            s_ptr, d_ptr = device_bufs[src.ordinal], device_bufs[dst.ordinal]
            what = f"device {src.ordinal} -> device {dst.ordinal}, {drv.fmt_bytes(COPY_NBYTES)}"
            gbps = _median_copy_gbps(
                lambda s, a=s_ptr, b=d_ptr, x=src, y=dst, w=what: drv.memcpy_peer_async(
                    b, y.context, a, x.context, COPY_NBYTES, s, w),
                streams[src.ordinal], COPY_NBYTES)
        rows.append({"src": src.ordinal, "dst": dst.ordinal, "gbps": gbps})
    return rows


def _pool_placement(g: Any) -> dict[str, Any]:
    """Where a pinned host pool for this GPU really lands (the rank's pool is made the same way)."""
    from tray.backend.cuda import hostmem

    drv.ctx_set_current(g.context, g.ordinal)
    mem = hostmem.pinned_host(g.ordinal, 64 << 20)
    try:
        p = mem.placement
        return {"ordinal": g.ordinal, "expected_node": p.expected, "pages_by_node": p.pages, "ok": p.ok,
                "how": mem.how}
    finally:
        mem.close()


def doctor_report(nccl_version: str | None = None) -> dict[str, Any]:
    """A dict with REPORT_KEYS: versions, `gpus` (one dict per GPU), `p2p` (one dict per ordered pair),
    `handle_types` ({ordinal, posix, fabric}: "ok" or the error code), `host_copy_gbps` ({ordinal, h2d,
    d2h}) and `peer_copy_gbps` ({src, dst, gbps}; None without peer access). GB/s = 1e9 bytes/s.

    `nccl_version` is the collectives' to say (the caller asks them: the backend knows no NCCL).
    Raises CudaError (a DeviceError) if the driver cannot be used at all.
    """
    drv.init()
    report: dict[str, Any] = {"driver_version": _version_text(drv.driver_version()),
                              "nccl_version": nccl_version}
    with ExitStack() as stack:
        stack.callback(drv.ctx_set_current, drv.ctx_get_current(), None)  # the caller's context, back
        gpus = []
        for ordinal in range(drv.device_count()):
            dev = drv.device_get(ordinal)
            ctx = drv.primary_ctx_retain(dev)
            stack.callback(drv.primary_ctx_release, dev)
            gpus.append(_Gpu(ordinal, dev, ctx))
        report["gpus"] = [_gpu_row(g) for g in gpus]
        report["p2p"] = [_p2p_row(a, b) for a in gpus for b in gpus if a.ordinal != b.ordinal]
        handle_rows = []
        for g in gpus:
            drv.ctx_set_current(g.context, g.ordinal)
            handle_rows.append({"ordinal": g.ordinal, "posix": _try_handle(g.ordinal, drv.HANDLE_POSIX),
                                "fabric": _try_handle(g.ordinal, drv.HANDLE_FABRIC)})
        report["handle_types"] = handle_rows
        device_bufs: dict[int, int] = {}
        streams: dict[int, Any] = {}
        for g in gpus:
            drv.ctx_set_current(g.context, g.ordinal)
            streams[g.ordinal] = drv.stream_create()
            stack.callback(_in_context, g, drv.stream_destroy, streams[g.ordinal])
            device_bufs[g.ordinal] = drv.mem_alloc(COPY_NBYTES)
            stack.callback(_in_context, g, drv.mem_free, device_bufs[g.ordinal])
        host = 0
        if gpus:
            drv.ctx_set_current(gpus[0].context, gpus[0].ordinal)
            host = drv.mem_host_alloc(COPY_NBYTES, portable=True)
            stack.callback(_in_context, gpus[0], drv.mem_free_host, host)
        report["host_copy_gbps"] = _host_copies(gpus, device_bufs, streams, host)
        report["host_pool_numa"] = [_pool_placement(g) for g in gpus]
        report["peer_copy_gbps"] = _peer_copies(gpus, report["p2p"], device_bufs, streams)
    return report


def _version_text(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def format_doctor(report: dict[str, Any]) -> str:
    """The report as readable text tables."""
    lines = [f"driver: CUDA {report['driver_version']}    NCCL: {report['nccl_version'] or 'not found'}", ""]
    lines.append(f"{'gpu':>3}  {'name':<22} {'uuid':<40} {'pci bus':<13} {'MiB':>7} {'cc':>4} {'numa':>4}")
    for g in report["gpus"]:
        lines.append(f"{g['ordinal']:>3}  {g['name'][:22]:<22} {g['uuid']:<40} {g['pci_bus']:<13} "
                     f"{g['memory_mib']:>7} {g['compute_capability']:>4} {g['numa_node']:>4}")
    ordinals = [g["ordinal"] for g in report["gpus"]]
    if len(ordinals) > 1:
        lines += ["", "peer access (P = access, A = native atomics) / copy GB/s, row = source:"]
        links = {(p["src"], p["dst"]): p for p in report["p2p"]}
        speeds = {(p["src"], p["dst"]): p["gbps"] for p in report["peer_copy_gbps"]}
        lines.append("      " + "".join(f"{'gpu ' + str(o):>14}" for o in ordinals))
        for a in ordinals:
            cells = []
            for b in ordinals:
                if a == b:
                    cells.append(f"{'-':>14}")
                    continue
                link, gbps = links[(a, b)], speeds.get((a, b))
                flags = ("P" if link["can_access_peer"] else ".") + ("A" if link["native_atomics"] else ".")
                cells.append(f"{flags + ' ' + (f'{gbps:.0f}' if gbps is not None else '-'):>14}")
            lines.append(f"gpu {a:<2}" + "".join(cells))
    lines += ["", f"{'gpu':>3}  {'posix fd':<24} {'fabric':<28} {'H2D GB/s':>9} {'D2H GB/s':>9}"]
    copies = {c["ordinal"]: c for c in report["host_copy_gbps"]}
    for h in report["handle_types"]:
        c = copies.get(h["ordinal"], {})
        lines.append(f"{h['ordinal']:>3}  {h['posix']:<24} {h['fabric']:<28} {c.get('h2d', '-'):>9} "
                     f"{c.get('d2h', '-'):>9}")
    if report.get("host_pool_numa"):
        lines += ["", "pinned host pool placement (pages by NUMA node, sampled):"]
        for p in report["host_pool_numa"]:
            verdict = "ok" if p["ok"] else "OFF NODE"
            lines.append(f"  gpu {p['ordinal']}: expected node {p['expected_node']}, pages {p['pages_by_node']} "
                         f"({p['how']}): {verdict}")
    return "\n".join(lines)

