"""The head's check of all offers before it hands out the table (docs/design.md section 5). Pure data."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from tray.handshake.wire import Offer
from tray.text import ranks_text


def _ranks(ranks: Iterable[int]) -> str:
    return ranks_text(sorted(ranks))


def _source(path: str, head: bool = False) -> str:
    if path:
        return path
    if head:
        return "the built-in default: no --manifest given"
    return "the built-in default: tray.init() without manifest="


def validate_offers(
    offers: Sequence[Offer],
    *,
    world_size: int,
    digest: str,
    uid: int,
    pids: Mapping[int, int],
    group_leaders: Mapping[str, Sequence[int]],
    shared_gpus: bool = False,
    manifest_path: str = "",
) -> list[str]:
    """Problems with a complete set of offers (empty when the tray may proceed).

    `pids`: rank -> pid of the process the head started. `group_leaders`: group name -> the ranks
    that lead (are member 0 of) an instance of it and must offer its join info. `shared_gpus`: the head placed
    several ranks on one GPU (--share-gpus), so one device claimed twice is expected. `manifest_path`: where the
    head's manifest came from ("" for the built-in default), for the message when the manifests differ.
    Each problem names the ranks at fault and what to do.
    """
    problems: list[str] = []
    by_rank = {o.rank: o for o in offers}
    for o in offers:
        if o.world_size != world_size:
            problems.append(f"rank {o.rank} believes the tray has {o.world_size} ranks, the head "
                            f"started {world_size}")
        if o.uid != uid:
            problems.append(f"rank {o.rank} runs as uid {o.uid}, the head as uid {uid}")
        if pids.get(o.rank) != o.pid:
            problems.append(f"rank {o.rank} offered from pid {o.pid}, but the head started pid "
                            f"{pids.get(o.rank)}; only processes the head started may join")

    digests: dict[tuple[str, str], list[int]] = defaultdict(list)
    for o in offers:
        digests[(o.manifest, o.manifest_path)].append(o.rank)
    if len({d for d, _ in digests}) > 1 or digest not in {d for d, _ in digests}:
        parts = sorted(digests.items(), key=lambda kv: len(kv[1]))
        said = "; ".join(f"{_ranks(rs)} offered manifest {d[:12]}... ({_source(path)})"
                         for (d, path), rs in parts)
        hint = "; tray launch --manifest FILE gives the head (and every rank) the program's manifest" \
            if not manifest_path else ""
        head = _source(manifest_path, head=True)
        problems.append(f"manifests differ: {said}; the head loaded {digest[:12]}... ({head}); run every rank with "
                        f"the same manifest file, kernels and vars{hint}")

    backends: dict[str, list[int]] = defaultdict(list)
    for o in offers:
        backends[o.backend].append(o.rank)
    if len(backends) > 1:
        problems.append("backends differ: " + "; ".join(f"{_ranks(r)} on {b}" for b, r in backends.items()))

    devices: dict[tuple[str, str], list[int]] = defaultdict(list)
    for o in offers:
        devices[(o.host, o.device.uuid)].append(o.rank)
    for (_, uuid), rs in devices.items():
        if len(rs) > 1 and not shared_gpus:
            problems.append(f"{_ranks(rs)} claim one device {uuid}; give each rank its own GPU "
                            "(check CUDA_VISIBLE_DEVICES and TRAY_DEVICE)")

    hosts = {o.host for o in offers}
    if len(hosts) > 1:
        local = [o.rank for o in offers if any(b.handle in ("posix", "memfd") for b in o.buffers)]
        if local:
            problems.append(f"{_ranks(local)} offered host-local handles (posix/memfd) but the tray spans "
                            f"{len(hosts)} hosts; such handles only work within one host")

    # NOTE: which buffers a rank exports depends on the groups it is in (a rank in no instance of a group exports
    # none of its buffers), so the sets may differ; a buffer several ranks export has one size (the digest proved
    # one manifest: a size that differs means the vars did)
    first: dict[str, tuple[int, int]] = {}  # buffer -> (rank, nbytes) of the first rank that exports it
    for o in sorted(offers, key=lambda o: o.rank):
        for b in o.buffers:
            if b.name.startswith("tray:"):  # tray's own, sized per group instance (instances may differ in size)
                continue
            seen = first.setdefault(b.name, (o.rank, b.nbytes))
            if seen[1] != b.nbytes:
                problems.append(f"rank {o.rank} offered buffer {b.name!r} of {b.nbytes} B, rank {seen[0]} of "
                                f"{seen[1]} B; check the vars of each rank")

    for group, leaders in group_leaders.items():
        for r in leaders:
            o = by_rank.get(r)
            if o is not None and group not in o.groups:
                problems.append(f"rank {r} leads group {group!r} but offered no join info for it")
    return problems
