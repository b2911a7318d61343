"""A 4-rank tray end to end on the host backend: handshake, peer tables, barrier, collectives."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from conftest import MANIFESTS

FILL = str(MANIFESTS / "peer_fill.json")


def test_plain_command_runs_without_handshake(tray_env):
    run = tray_env.launch(3, "print('hello from', os.environ['TRAY_RANK'], os.environ['WORLD_SIZE'])")
    assert run.returncode == 0, run.output
    for r in range(3):
        assert f"[rank {r}] hello from {r} 3" in run.stdout


def test_four_ranks_share_memory_barrier_and_exchange(tray_env):
    body = """
    from tray.backend.host.twins import peer_fill_words
    with tray.init() as rank:
        me, n = rank.rank, rank.world_size
        words = rank.buffer("fill").shape[0] // n
        peers = rank.peers("fill")
        assert len(peers.ptrs) == n and peers.ptrs[me] == rank.buffer("fill").ptr
        kernel = rank.kernel("peer_fill")
        kernel.launch((1, 1, 1), (32, 1, 1), [peers.table_ptr, n, me, words, 7])
        rank.barrier()
        got = rank.read("fill").reshape(n, words)
        for writer in range(n):
            assert (got[writer] == peer_fill_words(7, writer, me, words)).all(), writer
        # pairs group: instance {0,1} and {2,3}
        g = rank.group("pairs")
        assert g.members == ((0, 1) if me < 2 else (2, 3)), g
        rank.barrier("pairs")
        values = rank.exchange("sum", me * 10)
        assert values == [r * 10 for r in range(n)], values
        print("checked", n * words * 4, "bytes")
    """
    run = tray_env.launch(4, body, "--manifest", FILL)
    assert run.returncode == 0, run.output
    for r in range(4):
        assert f"[rank {r}] checked {4 * 4096 * 4} bytes" in run.stdout
    assert "tray up in" in run.stderr  # the startup timeline
    for phase in ("import", "manifest", "allocate", "table", "import_peers", "join", "ready"):
        assert phase in run.stderr
    # from `tray launch` started: the head's own start (interpreter, imports) counted before the first spawn
    m = re.search(r"tray up in ([0-9.]+) s after the first spawn, ([0-9.]+) s after `tray launch` started",
                  run.stderr)
    assert m and float(m.group(2)) > float(m.group(1)) > 0, run.stderr
    head = re.search(r"head +([0-9.]+) ms  the head's own start", run.stderr)
    assert head and 0 < float(head.group(1)) < 1000 * (float(m.group(2)) - float(m.group(1))) + 20, run.stderr


def test_a_topic_per_step_keeps_a_bounded_count_of_topics_and_a_round_given_up_stays_stale(tray_env):
    """A rank kept the round count of every exchange topic it used for the tray's life: a topic per step
    (`f"step-{i}"`) cost ~100 B a step (10 MiB a rank after 100k steps: bench/long_run.py). It keeps those of the
    topics used last (ROUNDS_KEPT). Rank 0 gives up exchange 'x' (its timeout) and rank 1 makes it late; after more
    other topics than are kept, both make 'x' again and take that step's values, not the decision of the step given
    up."""
    run = tray_env.launch(2, """
    from tray.handshake.steps import ROUNDS_KEPT
    with tray.init() as rank:
        if rank.rank == 0:
            try:
                rank.exchange("x", "given up", timeout_s=0.5)
            except tray.HandshakeError:
                print("gave up", flush=True)
        else:
            time.sleep(1.5)
            print("late:", rank.exchange("x", "late"), flush=True)
        for i in range(ROUNDS_KEPT + 500):
            assert rank.exchange(f"step-{i}", i) == [i, i]
        print("again:", rank.exchange("x", f"again {rank.rank}"), "kept:", len(rank._rounds), "of", ROUNDS_KEPT,
              flush=True)
    """, timeout_s=120)
    assert run.returncode == 0, run.output
    assert "[rank 0] gave up" in run.stdout and "[rank 1] late: ['given up', 'late']" in run.stdout, run.output
    kept = re.findall(r"again: \['again 0', 'again 1'\] kept: (\d+) of (\d+)", run.stdout)
    assert len(kept) == 2 and all(int(k) <= int(bound) for k, bound in kept), run.output


def test_host_collectives_match_numpy(tray_env):
    body = """
    with tray.init() as rank:
        me, n = rank.rank, rank.world_size
        count = rank.buffer("send").shape[0] // n
        rng = np.random.default_rng(1234)
        inputs = rng.standard_normal((n, n * count)).astype(np.float32)   # same on every rank
        c = rank.collectives("world")
        send, recv = rank.buffer("send"), rank.buffer("recv")
        rank.write("send", inputs[me])
        c.allreduce(send.ptr, recv.ptr, n * count, "f32")
        ref = inputs[0].copy()
        for i in range(1, n):
            ref += inputs[i]
        assert np.array_equal(rank.read("recv"), ref)
        c.allgather(send.ptr, recv.ptr, count, "f32")
        assert np.array_equal(rank.read("recv"), np.concatenate([inputs[i][:count] for i in range(n)]))
        c.reducescatter(send.ptr, recv.ptr, count, "f32")
        assert np.array_equal(rank.read("recv")[:count], ref[me * count:(me + 1) * count])
        c.alltoall(send.ptr, recv.ptr, count, "f32")
        want = np.concatenate([inputs[i][me * count:(me + 1) * count] for i in range(n)])
        assert np.array_equal(rank.read("recv"), want)
        print("collectives ok")
    """
    run = tray_env.launch(4, body, "--manifest", FILL, "--var", "count=256")
    assert run.returncode == 0, run.output
    assert run.stdout.count("collectives ok") == 4


def test_collectives_take_views_arrays_and_keywords_as_addresses(tray_env):
    """A collective's buffers as the views rank.buffer() gives, as arrays over them, or by keyword, work as their
    .ptr does; anything else is a UsageError saying what is expected (a tensor was 'Boolean value of Tensor with
    more than one value is ambiguous')."""
    run = tray_env.launch(2, """
    with tray.init() as rank:
        c = rank.collectives("world")
        send, recv = rank.buffer("send"), rank.buffer("recv")
        rank.write("send", np.full(send.shape, rank.rank + 1, np.float32))
        c.allreduce(send, recv, send.shape[0], "f32")
        assert np.all(rank.read("recv") == 3)
        rank.write("send", np.full(send.shape, 2 * (rank.rank + 1), np.float32))
        c.allreduce(np.asarray(send), recv_ptr=np.asarray(recv), count=send.shape[0], dtype="f32")
        assert np.all(rank.read("recv") == 6)
        try:
            c.allreduce("send", recv.ptr, send.shape[0], "f32")
        except tray.UsageError as exc:
            print("refused:", exc, flush=True)
    """, "--manifest", FILL, "--var", "count=64")
    assert run.returncode == 0, run.output
    assert run.stdout.count("refused: allreduce send_ptr: expected an address (an int, e.g. rank.buffer('x').ptr), "
                            "a tray view, or a tensor or array over tray memory; got str") == 2, run.output


def test_host_sendrecv_is_a_step_of_the_pair_alone(tray_env):
    """As with NCCL: ranks 0 and 1 exchange (20 rounds, both directions) while ranks 2 and 3 take no part (each
    sends to itself once); then all four meet at one barrier. Before, sendrecv was a step of the whole group
    sharing the group's barrier: ranks 2 and 3 waited in their sendrecv for 0 and 1's, and their last barrier
    could pass against the barrier inside it."""
    body = """
    with tray.init() as rank:
        me = rank.rank
        c = rank.collectives("world")
        send, recv = rank.buffer("send"), rank.buffer("recv")
        count = send.shape[0]
        if me < 2:
            for k in range(20):
                rank.write("send", np.full(count, 100 * me + k, np.float32))
                c.sendrecv(send.ptr, recv.ptr, count, "f32", 1 - me)
                got = rank.read("recv")
                assert np.all(got == 100 * (1 - me) + k), (me, k, got[:4])
        else:
            rank.write("send", np.full(count, me, np.float32))
            c.sendrecv(send.ptr, recv.ptr, count, "f32", me)
            assert np.all(rank.read("recv") == me)
        rank.barrier(timeout_s=30)
        print("pairs ok", me, flush=True)
    """
    run = tray_env.launch(4, body, "--manifest", FILL, "--var", "count=256", timeout_s=120)
    assert run.returncode == 0, run.output
    assert all(f"pairs ok {r}" in run.stdout for r in range(4)), run.output


def test_host_sendrecv_never_restages_rows_its_peer_is_still_reading(tray_env):
    """A member that finished round k of a sendrecv may not restage its scratch for round k+1 until its peer has read
    round k's rows: rank 1 reads the peer's rows late (a slow reader, made so here), and still gets each round's."""
    body = """
    import tray.collectives.host as host
    with tray.init() as rank:
        me = rank.rank
        c = rank.collectives("world")
        send, recv = rank.buffer("send"), rank.buffer("recv")
        count = send.shape[0]
        if me == 1:
            plain = host.view

            def slow_view(ptr, nbytes):
                if ptr not in (send.ptr, recv.ptr):  # the scratch: this member's own, or the peer's rows it reads
                    time.sleep(0.05)
                return plain(ptr, nbytes)

            host.view = slow_view
        for k in range(6):
            rank.write("send", np.full(count, 100 * me + k, np.float32))
            c.sendrecv(send.ptr, recv.ptr, count, "f32", 1 - me)
            got = rank.read("recv")
            assert np.all(got == 100 * (1 - me) + k), (me, k, got[:4])
        print("rounds ok", me, flush=True)
    """
    run = tray_env.launch(2, body, "--manifest", FILL, "--var", "count=256", timeout_s=120)
    assert run.returncode == 0, run.output
    assert all(f"rounds ok {r}" in run.stdout for r in range(2)), run.output


def test_a_manifest_sendrecv_exchanges_with_the_member_its_peer_counts_to(tray_env, tmp_path):
    """docs/manifest.md's op: `"peer": 1` in a group of 2 pairs its members (it was member index 1 for both, so
    member 1 exchanged with itself: NCCL would hang; the host backend's pairwise sendrecv waited for it)."""
    manifest = tmp_path / "swap.json"
    manifest.write_text(json.dumps({
        "format": 1, "name": "swap", "groups": [{"name": "pairs", "size": 2}],
        "buffers": [{"name": "a", "dtype": "f32", "shape": [64]}, {"name": "b", "dtype": "f32", "shape": [64]}],
        "programs": [{"name": "swap", "ops": [{"op": "nccl", "collective": "sendrecv", "group": "pairs", "send": "a",
                                               "recv": "b", "count": 64, "dtype": "f32", "peer": 1}]}]}))
    run = tray_env.launch(4, """
    with tray.init() as rank:
        rank.write("a", np.full(64, rank.rank, np.float32))
        rank.run("swap")
        print("got", rank.rank, int(rank.read("b")[0]), flush=True)
    """, "--manifest", str(manifest), timeout_s=60)
    assert run.returncode == 0, run.output
    for me, other in ((0, 1), (1, 0), (2, 3), (3, 2)):
        assert f"got {me} {other}" in run.stdout, run.output


def test_host_collectives_wait_the_ranks_barrier_timeout_and_name_the_collective(tray_env):
    """--barrier-timeout-s reaches the host backend's collectives (they waited 2 s whatever it said)."""
    body = """
    with tray.init() as rank:
        c = rank.collectives("world")
        send, recv = rank.buffer("send"), rank.buffer("recv")
        if rank.rank == 1:
            time.sleep(3)
        c.allreduce(send.ptr, recv.ptr, send.shape[0], "f32")
        print("allreduce ok", rank.rank, flush=True)
        if rank.rank == 1:
            time.sleep(60)
        c.allreduce(send.ptr, recv.ptr, send.shape[0], "f32")
    """
    run = tray_env.launch(2, body, "--manifest", FILL, "--var", "count=256", "--barrier-timeout-s", "6",
                          timeout_s=120)
    assert run.returncode == 1, run.output
    assert "allreduce ok 0" in run.stdout and "allreduce ok 1" in run.stdout, run.output
    assert "barrier world (in allreduce) epoch 3: rank 0 waited 6.0" in run.stderr, run.stderr
    assert run.seconds < 40


@pytest.mark.parametrize("fault", ["count", "kind", "sendrecv", "range", "sendrecv_vs_group"])
def test_host_collectives_name_members_that_called_different_collectives(tray_env, fault):
    """With NCCL these hang or read and write past the buffers; on the host backend (before, rank 0 silently got
    other numbers than its peers, exit 0) they fail naming who called what."""
    call = {
        "count": 'c.allreduce(send.ptr, recv.ptr, 128 if me == 0 else 256, "f32")',
        "kind": 'getattr(c, "allgather" if me == 0 else "allreduce")(send.ptr, recv.ptr, 64, "f32")',
        "sendrecv": 'c.sendrecv(send.ptr, recv.ptr, 32 if me == 0 else 64, "f32", me ^ 1)',
        "range": 'c.allreduce(send.ptr, recv.ptr, 4096, "f32")',
        "sendrecv_vs_group": 'c.sendrecv(send.ptr, recv.ptr, 64, "f32", 1) if me == 0 else '
                             'c.allreduce(send.ptr, recv.ptr, 64, "f32")',
    }[fault]
    body = f"""
    with tray.init() as rank:
        me = rank.rank
        c = rank.collectives("world")
        send, recv = rank.buffer("send"), rank.buffer("recv")
        {call}
        print("no error", me, flush=True)
    """
    run = tray_env.launch(2, body, "--manifest", FILL, "--var", "count=256", timeout_s=60)
    assert run.returncode == 1, run.output
    assert "no error" not in run.stdout, run.output
    want = {
        "count": "group 'world': its members called different collectives: rank 0: allreduce of 128 f32 (its call 1 "
                 "on the group); rank 1: allreduce of 256 f32 (its call 1 on the group)",
        "kind": "rank 0: allgather of 64 f32 (its call 1 on the group); rank 1: allreduce of 64 f32",
        "sendrecv": "sendrecv round 1 between rank 0 and rank 1: rank 0 sends 32 f32, rank 1 64 f32; both must send "
                    "the same count and dtype",
        "range": "allreduce of 4096 f32 over group 'world': its send range reaches 16384 B at 0x",
        "sendrecv_vs_group": "every member must make the same collective calls in the same order",
    }[fault]
    assert want in run.stderr, run.stderr
    if fault == "sendrecv_vs_group":   # either side may be first to say it
        assert ("rank 0 called sendrecv with rank 1, which called allreduce of 64 f32 (its call 1 on the group)"
                in run.stderr or "rank 1 called allreduce (its call 1 on the group) while rank 0 called sendrecv "
                "with it" in run.stderr), run.stderr
    if fault == "range":
        assert "(0 B into buffer 'send' of 2048 B), past its end: pass a count that fits the buffer" in run.stderr


def test_a_manifest_given_by_tray_init_alone_is_taken_by_the_head(tray_env, tmp_path):
    """`tray.init(manifest=FILE)` without `tray launch --manifest` (docs/manifest.md offers both): the head, given
    none, takes the file every rank loaded. Before, the offers 'disagreed' with the head's built-in default. Ranks
    that load different files are named with their files."""
    run = tray_env.launch(2, f"""
    with tray.init(manifest={FILL!r}) as rank:
        c = rank.collectives("world")
        send, recv = rank.buffer("send"), rank.buffer("recv")
        rank.write("send", np.ones(send.shape, np.float32))
        c.allreduce(send.ptr, recv.ptr, send.shape[0], "f32")
        assert np.all(rank.read("recv") == 2)
        print("adopted", rank.rank, flush=True)
    """, timeout_s=60)
    assert run.returncode == 0, run.output
    assert "adopted 0" in run.stdout and "adopted 1" in run.stdout
    base, link = tmp_path / "base.json", tmp_path / "link.json"   # one file by two names, and a var for it
    base.write_text(json.dumps({"format": 1, "name": "b", "vars": {"count": 4},
                                "buffers": [{"name": "send", "dtype": "f32", "shape": ["count"]}]}))
    link.symlink_to(base)
    run = tray_env.launch(2, f"""
    with tray.init(manifest={str(link)!r} if os.environ["TRAY_RANK"] == "1" else {str(base)!r}) as rank:
        print("count", rank.rank, rank.buffer("send").shape[0], flush=True)
    """, "--var", "count=32", timeout_s=60)
    assert run.returncode == 0, run.output
    assert "count 0 32" in run.stdout and "count 1 32" in run.stdout, run.output
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": 1, "name": "other"}))
    run = tray_env.launch(2, f"""
    with tray.init(manifest={str(other)!r} if os.environ["TRAY_RANK"] == "1" else {FILL!r}) as rank:
        pass
    """, timeout_s=60)
    assert run.returncode == 3, run.output
    assert "rank 0 offered manifest" in run.stderr and f"({FILL})" in run.stderr and f"({other})" in run.stderr
    assert "the head loaded" in run.stderr and "(the built-in default: no --manifest given)" in run.stderr


def test_tray_init_takes_a_built_in_manifest_by_name(tray_env):
    """`tray.init(manifest="peer_fill")` (docs/api.md: a file or a built-in's name, as `--manifest` takes): the ranks
    load the built-in and the head takes it. Before, the name was read as a file: every rank failed with
    ManifestError 'cannot read the manifest'. A name that is neither is one line naming the built-ins."""
    run = tray_env.launch(2, """
    with tray.init(manifest="peer_fill") as rank:
        rank.barrier()
        print("named", rank.rank, rank.manifest.name, flush=True)
    """, "-q", timeout_s=60)
    assert run.returncode == 0, run.output
    assert "named 0 peer_fill" in run.stdout and "named 1 peer_fill" in run.stdout, run.output
    run = tray_env.launch(2, """
    with tray.init(manifest="peer_fil") as rank:
        pass
    """, "-q", timeout_s=60)
    assert run.returncode == 2, run.output
    assert "no manifest file 'peer_fil' in " in run.stderr and \
        "and no built-in manifest of that name; did you mean 'peer_fill'?" \
        in run.stderr, run.stderr


def test_a_manifest_whose_path_is_not_utf8_runs(tray_env, tmp_path):
    """A manifest file under a name that is not UTF-8 (a path from another locale): the ranks load it and the tray
    runs. The offer once carried the path as it was and could not be encoded: every rank failed with WireError."""
    odd = tmp_path / os.fsdecode(b"dir-\xff")
    odd.mkdir()
    path = odd / os.fsdecode(b"m\xe9.json")
    path.write_text(json.dumps({"format": 1, "name": "m", "buffers": [{"name": "x", "dtype": "u32", "shape": [16],
                                                                     "export": True}]}))
    run = tray_env.launch(2, """
    with tray.init() as rank:
        rank.barrier()
        print("ran", rank.rank, rank.buffer("x").shape, flush=True)
    """, "-q", "--manifest", str(path))
    assert run.returncode == 0, run.output
    assert "ran 0 (16,)" in run.stdout and "ran 1 (16,)" in run.stdout, run.output
    run = tray_env.launch(2, f"""
    with tray.init(manifest=os.fsdecode({os.fsencode(path)!r})) as rank:
        rank.barrier()
        print("took", rank.rank, rank.buffer("x").shape, flush=True)
    """, "-q")  # given by tray.init() alone: the head takes it from the offers' path
    assert run.returncode == 0, run.output
    assert "took 0 (16,)" in run.stdout and "took 1 (16,)" in run.stdout, run.output


def test_write_refuses_data_of_another_dtype_and_a_clean_sys_exit_code_is_named(tray_env):
    """float64 data written into an f32 buffer stored its bytes unconverted (reading back [0. 1.875 0. 1.875]);
    raw bits (an integer array of the element's size, or uint8) are still written as they are. A rank that leaves
    its `with` block by sys.exit(3) is named with its code in the phase it left from (not 'bye')."""
    body = """
    from tray.errors import UsageError
    with tray.init() as rank:
        rank.write("send", np.arange(4, dtype=np.float32))
        rank.write("send", np.full(4, 0x3F800000, np.uint32))   # 1.0f as raw bits
        assert rank.read("send")[:4].tolist() == [1.0] * 4
        for data in (np.ones(4), [1, 2, 3], np.ones(10 ** 6, np.float32)):
            try:
                rank.write("send", data)
            except UsageError as exc:
                print("refused:", exc, flush=True)
        if rank.rank == 0:
            sys.exit(3)
        time.sleep(30)
    """
    run = tray_env.launch(2, body, "--manifest", FILL, "--var", "count=64", timeout_s=60)
    assert run.returncode == 1, run.output
    refused = [line.split("refused: ", 1)[1] for line in run.stdout.splitlines() if "[rank 0] refused: " in line]
    assert refused == [
        "write('send'): float64 data into a f32 buffer would store its bytes unconverted; convert it first "
        "(np.asarray(data, 'float32')), or pass the raw bits as an integer array of 4 B per element or as uint8",
        "write('send'): int64 data into a f32 buffer would store its bytes unconverted; convert it first "
        "(np.asarray(data, 'float32')), or pass the raw bits as an integer array of 4 B per element or as uint8",
        "write('send'): 4000000 B (1000000 x float32) do not fit buffer 'send' of 512 B (f32[128])"] * 1, run.stdout
    assert "rank 0 (pid" in run.stderr and "exited with code 3 (last phase: running)" in run.stderr, run.stderr


def test_odd_arguments_to_writes_and_collectives_are_usage_errors(tray_env):
    """A ragged list given to write() raised numpy's ValueError; a collective given count None or -1, a sendrecv peer
    None, a dtype that is an array, or an address of 0, 1 or 2**70 raised TypeError, OverflowError, ValueError or
    killed the rank (SIGSEGV reading address 1), as did an address of memory unmapped since; a timeout given as a
    string raised float()'s ValueError; memory mapped without access (PROT_NONE) as a send range, or read-only as a
    receive range, killed it."""
    body = """
    from tray.errors import UsageError
    with tray.init() as rank:
        c, send, recv = rank.collectives("world"), rank.buffer("send"), rank.buffer("recv")
        calls = [lambda: rank.write("send", [[1.0], [1.0, 2.0]]), lambda: c.allreduce(send, recv, None, "f32"),
                 lambda: c.allreduce(send, recv, -1, "f32"), lambda: c.sendrecv(send, recv, 4, "f32", None),
                 lambda: c.allreduce(send, recv, 4, np.array(["f32", "f32"])), lambda: c.allreduce(0, recv, 4, "f32"),
                 lambda: c.allreduce(1, recv, 4, "f32"), lambda: c.allreduce(send, 2 ** 70, 4, "f32"),
                 lambda: rank.exchange("t", 1, "5"), lambda: rank.barrier("world", "5")]
        import ctypes, mmap

        def freed():   # memory unmapped just now (12 KiB: no mapping of that size comes between): reading it killed
            gone = mmap.mmap(-1, 12288)   # the rank (SIGSEGV)
            address = ctypes.addressof(ctypes.c_char.from_buffer(gone))
            gone.close()
            return address

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                  ctypes.c_int, ctypes.c_int, ctypes.c_long]

        def held(prot):   # mapped, but without the access a collective needs: reading a reservation (PROT_NONE, as
            address = libc.mmap(None, 8192, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)  # a GPU driver's
            assert address not in (None, 2 ** 64 - 1), "mmap failed"   # range, or a guard page) or writing a
            return address                                             # read-only page killed the rank
        mine = np.zeros(4, np.float32)
        calls += [lambda: c.allreduce(freed(), recv, 4, "f32"),
                  lambda: c.allreduce(mine.ctypes.data, recv, 10 ** 15, "f32"),   # a count past its end
                  lambda: c.allreduce(2 ** 64 - 8, recv, 4, "f32"),
                  lambda: c.allreduce(held(0), recv, 4, "f32"),
                  lambda: c.allreduce(send, held(mmap.PROT_READ), 4, "f32")]
        for call in calls:
            try:
                call()
            except UsageError as exc:
                print("refused:", str(exc).splitlines()[0], flush=True)
        c.allreduce(send, recv, np.int64(4), "f32")   # a numpy count is still taken
        rank.barrier()
    """
    run = tray_env.launch(2, body, "--manifest", FILL, "--var", "count=64", timeout_s=60)
    assert run.returncode == 0, run.output
    refused = [line for line in run.stdout.splitlines() if line.startswith("[rank 0] refused: ")]
    assert len(refused) == 15, run.stdout
    assert "write('send'): takes a numpy array" in refused[0] and "count is a number of elements" in refused[1]
    assert "its send address 0 is no memory" in refused[5], refused
    assert "its receive address 1180591620717411303424 is no memory" in refused[7], refused
    assert all("timeout_s must be a number of seconds > 0" in r for r in refused[8:10]), refused
    assert re.search(r"allreduce of 4 f32 over group 'world': its send range of 16 B at 0x[0-9a-f]+ is not all memory "
                     r"of this process", refused[10]), refused
    assert re.search(r"allreduce of 1000000000000000 f32 over group 'world': its send range of 4000000000000000 B at "
                     r"0x[0-9a-f]+ is not all memory of this process", refused[11]), refused
    assert "its send range of 16 B at 0xfffffffffffffff8 runs past the end of the address space" in refused[12], refused
    assert re.search(r"its send range of 16 B at 0x[0-9a-f]+ has memory mapped without access at 0x[0-9a-f]+ \(0 B "
                     r"in\): a reservation such as a GPU's device memory", refused[13]), refused
    assert re.search(r"its receive range of 16 B at 0x[0-9a-f]+ has read-only memory at 0x[0-9a-f]+ \(0 B in\), which "
                     r"this rank may not write", refused[14]), refused


def test_a_group_that_leaves_ranks_out_forms_and_its_members_meet(tray_env, tmp_path):
    """A rank may be in no instance of a group (docs/manifest.md): it exports none of its buffers, and the head
    refused the offers because not every rank exported the same set."""
    manifest = tmp_path / "some.json"
    manifest.write_text(json.dumps({
        "format": 1, "name": "some", "groups": [{"name": "some", "ranks": [[3, 1]]}],
        "buffers": [{"name": "x", "dtype": "u32", "shape": [8], "export": True, "group": "some"},
                    {"name": "y", "dtype": "u32", "shape": [8], "group": "some"}],
        "programs": [{"name": "sum", "ops": [{"op": "barrier", "group": "some"},
                                              {"op": "nccl", "collective": "allreduce", "group": "some", "send": "x",
                                               "recv": "y", "count": 8, "dtype": "u32"}]}]}))
    run = tray_env.launch(4, """
    with tray.init() as rank:
        if rank.rank in (1, 3):
            rank.barrier("some", timeout_s=30)
            print("met", rank.rank, rank.peers("x").group.members, flush=True)
            rank.write("x", np.full(8, rank.rank, np.uint32))
        rank.run("sum")   # the program's ops over 'some' are nothing on ranks 0 and 2
        if rank.rank in (1, 3):
            print("sum", rank.rank, int(rank.read("y")[0]), flush=True)
        rank.barrier(timeout_s=30)
    """, "--manifest", str(manifest), timeout_s=60)
    assert run.returncode == 0, run.output
    assert "met 1 (3, 1)" in run.stdout and "met 3 (3, 1)" in run.stdout, run.output
    assert "sum 1 4" in run.stdout and "sum 3 4" in run.stdout, run.output


def test_gate_peer_barrier_and_drop(tray_env, tmp_path):
    import sys

    out = tmp_path / "gate.json"
    run = tray_env.run([sys.executable, "-m", "tray", "gate", "peer-barrier", "-n", "4", "--backend", "host",
                        "--iters", "50", "--json", str(out)], timeout_s=120)
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    assert report["passed"] and len(report["per_rank"]) == 4
    assert all(r["eager_us"] > 0 and r["captured_us"] > 0 for r in report["per_rank"])
    assert report["environment"]["commit"]

    out = tmp_path / "drop.json"
    run = tray_env.run([sys.executable, "-m", "tray", "gate", "peer-barrier", "-n", "4", "--backend", "host",
                        "--drop", "1", "--timeout-s", "1", "--json", str(out)], timeout_s=60)
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    assert [c["named"] for c in report["drop_checks"]] == [[1], [1], [1]]
    assert all(c["seconds"] <= 1.5 for c in report["drop_checks"])
    assert run.seconds < 20


def test_gate_stress_passes_and_fails_on_a_wrong_word(tray_env, tmp_path):
    import sys

    base = [sys.executable, "-m", "tray", "gate", "peer-barrier", "-n", "3", "--backend", "host", "--stress",
            "--iters", "12", "--replays", "2"]
    out = tmp_path / "stress.json"
    run = tray_env.run([*base, "--json", str(out)], timeout_s=120)
    assert run.returncode == 0, run.output
    report = json.loads(out.read_text())
    assert report["passed"] and report["mismatches"] == 0
    assert [r["stress"]["rounds"] for r in report["per_rank"]] == [36, 36, 36]

    out = tmp_path / "corrupt.json"
    run = tray_env.run([*base, "--corrupt", "2", "--json", str(out)], timeout_s=120)
    assert run.returncode == 1, run.output
    report = json.loads(out.read_text())
    assert not report["passed"] and report["mismatches"] == 1
    victim = report["per_rank"][0]["stress"]  # rank 2 sends its wrong word to (2 + 1) % 3 = 0
    assert victim["bad_writers"] == [2] and victim["first_bad_round"] == 3
    assert "FAILED" in run.stdout


def test_usage_error_outside_a_tray(tray_env):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import tray; tray.init()"], capture_output=True, text=True,
                          timeout=30, env=tray_env.env())
    assert proc.returncode != 0
    assert "tray launch -n N" in proc.stderr


def test_log_dir_keeps_one_file_per_rank(tray_env, tmp_path):
    logs = tmp_path / "logs"
    run = tray_env.launch(2, "print('to the log', os.environ['TRAY_RANK'])", "--log-dir", str(logs))
    assert run.returncode == 0, run.output
    for r in range(2):
        text = (logs / f"rank-{r}.log").read_text()
        assert f"to the log {r}" in text


def test_ranks_sharing_a_gpu_get_it_and_each_its_own_nccl_hostid(tray_env, monkeypatch, capfd):
    """--share-gpus as the head wires it (the placement forced here: no GPU on this machine): every rank gets the
    shared ordinal as TRAY_DEVICE and an NCCL_HOSTID of its own built on this host's, and the head says so."""
    import tray.launch.head as head
    from tray.launch import TraySpec, run_tray

    monkeypatch.setattr(head, "devices_for", lambda backend, n, share: [0] * n)
    monkeypatch.setenv("TRAY_JOBS_ROOT", str(tray_env.jobs_root))
    monkeypatch.setenv("NCCL_HOSTID", "box")
    prog = tray_env.script("""
    with tray.init() as rank:
        print("placed", rank.rank, os.environ["TRAY_DEVICE"], os.environ["NCCL_HOSTID"], flush=True)
    """)
    spec = TraySpec(nprocs=3, cmd=(sys.executable, str(prog), tray_env.marker), backend="host", timeline=False)
    assert run_tray(spec).exit_code == 0
    out, err = capfd.readouterr()
    placed = sorted(line.split("placed ", 1)[1] for line in out.splitlines() if "placed " in line)
    assert placed == [f"{r} 0 box/tray-rank-{r}" for r in range(3)], out
    assert "tray: --share-gpus: 3 ranks on 1 GPU(s) (GPU 0: ranks 0,1,2)" in err, err


def test_objects_kept_past_close_kernel_arguments_and_calls_the_host_lacks_are_usage_errors(tray_env):
    """A barrier object kept past close() read the unmapped flags (SIGSEGV), collectives kept past it said "not all
    memory of this process" or raised IndexError, and a kernel kept past it launched its twin on freed memory; each
    now says it was used after close(). A view given as a kernel argument reached the twin as a view (TypeError in
    the twin), where the cuda backend passes its address; a grid of 0 was taken. send/recv/batch on the host raised
    AttributeError. A barrier that timed out said, at every later call, the same words as the first time."""
    body = """
    from tray.errors import BarrierTimeout, UsageError

    def refused(call):
        try:
            call()
        except UsageError as exc:
            print("refused:", str(exc).splitlines()[0], flush=True)
        else:
            print("taken", flush=True)

    rank = tray.init()
    k, c, bo = rank.kernel("peer_fill"), rank.collectives("world"), rank.barrier_of("world")
    fill = rank.buffer("fill")
    G, me, words = rank.world_size, rank.rank, fill.nbytes // 4 // rank.world_size
    k.launch(1, 1, [rank.peers("fill"), np.int32(G), me, np.uint64(words), 7])   # a peer table; numpy scalars
    rank.barrier()
    from tray.backend.host.twins import peer_fill_words
    assert all((rank.read("fill")[s * words:(s + 1) * words] == peer_fill_words(7, s, me, words)).all()
               for s in range(G))
    refused(lambda: k.launch(0, 1, [rank.peers("fill"), G, me, words, 7]))
    bound = k.bind(1, 1, [rank.peers("fill"), G, me, words, 7])   # a hot loop's, kept past close()
    for call in (lambda: c.send(rank.buffer("send"), 4, "f32", 0), lambda: c.recv(rank.buffer("recv"), 4, "f32", 0),
                 lambda: c.batch()):
        refused(call)
    rank.barrier()
    if rank.rank == 1:
        for _ in range(2):
            try:
                rank.barrier(timeout_s=0.2)
            except BarrierTimeout as exc:
                print("timeout:", str(exc), flush=True)
    rank.close()
    refused(lambda: bo.wait(1.0))
    refused(lambda: bo.launch(1.0))
    refused(lambda: c.allreduce(np.zeros(4, np.float32), np.zeros(4, np.float32), 4, "f32"))
    refused(lambda: k.launch(1, 1, [0, G, me, words, 7]))
    refused(bound.launch)   # it wrote through the unmapped peer mappings: SIGSEGV
    print("phase", rank.phase, flush=True)
    """
    run = tray_env.launch(2, body, "--manifest", FILL, timeout_s=60)
    assert run.returncode == 0, run.output
    for r in (0, 1):
        lines = [line.split(" ", 2)[2] for line in run.stdout.splitlines() if line.startswith(f"[rank {r}] ")]
        refused = [line for line in lines if line.startswith("refused:")]
        assert len(refused) == 9 and "taken" not in lines, lines
        assert "kernel 'peer_fill': grid must be an int or 1-3 ints, each >= 1, got 0" in refused[0], refused
        assert all("is NCCL's (cuda backend); these collectives have no point-to-point calls: use sendrecv" in x
                   for x in refused[1:4]), refused
        for line, what in zip(refused[4:], ("the barrier of group 'world'", "the barrier of group 'world'",
                                            "the collectives of group 'world'", "kernel 'peer_fill'",
                                            "a launch of kernel 'peer_fill' bound before")):
            assert f"refused: {what}: used after close() of its rank" in line, refused
        assert lines[-1] == "phase closed", lines
    timeouts = [line for line in run.stdout.splitlines() if line.startswith("[rank 1] timeout:")]
    assert len(timeouts) == 2, run.stdout
    assert "raised again" not in timeouts[0] and "waited 0.2" in timeouts[0], timeouts
    assert "raised again by a later call: after a timeout this barrier stays failed on this rank" in timeouts[1]


def test_collectives_called_from_two_threads_at_once_are_refused_naming_both(tray_env):
    """Two threads of a rank in collectives of one group at once posted into the same slots: the members' calls were
    paired wrongly and the mismatch blamed on the order of calls (or, with equal data, nothing was said). The second
    call is a UsageError naming both threads; the first goes on and is right."""
    body = """
    import threading
    from tray.errors import UsageError
    with tray.init() as rank:
        c = rank.collectives("world")
        x = np.full(64, rank.rank + 1.0, np.float32)
        y = np.zeros(64, np.float32)
        if rank.rank == 0:
            worker = threading.Thread(target=lambda: c.allreduce(x, y, 64, "f32"), name="worker")
            worker.start()
            time.sleep(0.5)   # the worker waits in its allreduce: rank 1 comes later
            try:
                c.allreduce(x, np.zeros(64, np.float32), 64, "f32")
            except UsageError as exc:
                print("refused:", exc, flush=True)
            worker.join(30)
        else:
            time.sleep(1.5)
            c.allreduce(x, y, 64, "f32")
        print("sum", float(y[0]), flush=True)
    """
    run = tray_env.launch(2, body, "--manifest", FILL, "--barrier-timeout-s", "20", timeout_s=60)
    assert run.returncode == 0, run.output
    assert ("refused: group 'world': allreduce called on thread 'MainThread' while thread 'worker' is in its allreduce "
            "on this group") in run.stdout, run.stdout
    assert run.stdout.count("sum 3.0") == 2, run.stdout


def test_a_collective_after_its_groups_barrier_timed_out_says_it_is_that_timeout_again(tray_env):
    """The host collectives re-told their barrier's timeout as a fresh one, dropping the note that says a later call
    meets the same timeout (the barrier stays failed on that rank), so the second call read as a new wait."""
    body = """
    from tray.errors import BarrierTimeout
    with tray.init() as rank:
        c = rank.collectives("world")
        if rank.rank == 1:
            for _ in range(2):
                try:
                    c.allreduce(np.ones(4, np.float32), np.zeros(4, np.float32), 4, "f32")
                except BarrierTimeout as exc:
                    print("timeout:", exc, flush=True)
        time.sleep(3)
    """
    run = tray_env.launch(2, body, "--manifest", FILL, "--barrier-timeout-s", "0.5", timeout_s=60)
    assert run.returncode == 0, run.output
    said = [line for line in run.stdout.splitlines() if line.startswith("[rank 1] timeout:")]
    assert len(said) == 2 and all("(in allreduce)" in line for line in said), run.stdout
    assert "raised again" not in said[0] and "raised again by a later call" in said[1], said
