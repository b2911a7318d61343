"""The head's offer validation names the ranks at fault."""

from __future__ import annotations

from tray.handshake.validate import validate_offers
from tray.handshake.wire import BufferOffer, DeviceIdentity, Offer

DIGEST = "a" * 64
OTHER = "b" * 64


def offer(rank: int, *, manifest: str = DIGEST, uuid: str | None = None, nbytes: int = 4096, host: str = "boot",
          backend: str = "host", groups: dict | None = None, uid: int = 1000, pid: int | None = None,
          path: str = "") -> Offer:
    return Offer(
        token="t", rank=rank, world_size=4, host=host, pid=pid or 100 + rank, uid=uid,
        device=DeviceIdentity(ordinal=rank, uuid=uuid or f"dev-{rank}", pci_bus="", numa_node=-1),
        backend=backend, manifest=manifest, fd_socket=f"/tmp/rank-{rank}.fds",
        buffers=(BufferOffer(name="x", nbytes=nbytes, handle="memfd", fabric=None),), groups=groups or {},
        timings={}, manifest_path=path,
    )


def check(offers, leaders=None):
    return validate_offers(offers, world_size=4, digest=DIGEST, uid=1000, pids={r: 100 + r for r in range(4)},
                           group_leaders=leaders or {})


def test_agreeing_offers_pass():
    assert check([offer(r) for r in range(4)]) == []


def test_digest_minority_named_first():
    (problem,) = check([offer(0), offer(1, manifest=OTHER), offer(2), offer(3)])
    assert problem.startswith(f"manifests differ: rank 1 offered manifest {OTHER[:12]}... (the built-in default: "
                              "tray.init() without manifest=); ranks 0,2,3 offered")


def test_differing_manifests_name_their_files_and_how_to_give_the_head_one():
    (problem,) = check([offer(r, manifest=OTHER, path="/w/ring.json") for r in range(4)])
    assert problem == (f"manifests differ: ranks 0,1,2,3 offered manifest {OTHER[:12]}... (/w/ring.json); the head "
                       f"loaded {DIGEST[:12]}... (the built-in default: no --manifest given); run every rank with the "
                       "same manifest file, kernels and vars; tray launch --manifest FILE gives the head (and every "
                       "rank) the program's manifest")


def test_device_claimed_twice():
    (problem,) = check([offer(0), offer(1, uuid="dev-0"), offer(2), offer(3)])
    assert "ranks 0,1 claim one device dev-0" in problem


def test_device_claimed_twice_is_expected_when_the_head_shared_gpus():
    offers = [offer(r, uuid="dev-0") for r in range(4)]
    assert validate_offers(offers, world_size=4, digest=DIGEST, uid=1000, pids={r: 100 + r for r in range(4)},
                           group_leaders={}, shared_gpus=True) == []


def test_buffer_size_mismatch_and_uid_and_pid():
    problems = check([offer(0), offer(1, nbytes=8192), offer(2, uid=0), offer(3, pid=999)])
    text = "\n".join(problems)
    assert "rank 1 offered buffer 'x' of 8192 B, rank 0 of 4096 B" in text
    assert "rank 2 runs as uid 0" in text
    assert "rank 3 offered from pid 999, but the head started pid 103" in text


def test_local_handles_across_hosts_and_missing_join_info():
    problems = check([offer(0), offer(1), offer(2, host="other"), offer(3)], leaders={"world": [0]})
    text = "\n".join(problems)
    assert "host-local handles" in text
    assert "rank 0 leads group 'world' but offered no join info" in text


def test_join_info_of_every_leader_checked_empty_is_fine():
    leaders = {"world": [0], "pairs": [0, 2]}
    offers = [offer(0, groups={"world": b"", "pairs": b"id"}), offer(1), offer(2), offer(3)]
    assert check(offers, leaders) == ["rank 2 leads group 'pairs' but offered no join info for it"]
    offers[2] = offer(2, groups={"pairs": b""})
    assert check(offers, leaders) == []


def test_buffer_sets_may_differ_and_trays_own_buffers_are_sized_per_instance():
    """A rank in no instance of a group exports none of its buffers; tray's own buffers are sized per instance,
    and instances may differ in size. A manifest buffer of two sizes still means the vars differ."""
    def with_buffers(r: int, *buffers: tuple[str, int]) -> Offer:
        o = offer(r)
        return Offer(token=o.token, rank=r, world_size=4, host=o.host, pid=o.pid, uid=o.uid, device=o.device,
                     backend=o.backend, manifest=o.manifest, fd_socket=o.fd_socket, groups={}, timings={},
                     buffers=tuple(BufferOffer(name=n, nbytes=b, handle="memfd", fabric=None) for n, b in buffers))

    own = "tray:collectives:g"
    offers = [with_buffers(0, (own, 8192)), with_buffers(1, (own, 8192)), with_buffers(2, (own, 4096)),
              with_buffers(3, (own, 4096), ("x", 64))]
    assert check(offers) == []
    offers[2] = with_buffers(2, (own, 4096), ("x", 128))
    (problem,) = check(offers)
    assert problem == "rank 3 offered buffer 'x' of 64 B, rank 2 of 128 B; check the vars of each rank"


def test_a_rank_that_believes_another_world_size_is_named_whether_it_counts_fewer_or_more():
    from dataclasses import replace

    for believed in (2, 8):
        offers = [offer(0), offer(1), replace(offer(2), world_size=believed), offer(3)]
        assert check(offers) == [f"rank 2 believes the tray has {believed} ranks, the head started 4"]


def test_ranks_on_different_backends_are_named_by_backend():
    (problem,) = check([offer(0), offer(1, backend="cuda"), offer(2), offer(3, backend="cuda")])
    assert problem == "backends differ: ranks 0,2 on host; ranks 1,3 on cuda"
