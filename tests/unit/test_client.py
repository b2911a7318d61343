"""The rank's connection to the head (tray/handshake/client.py) against a head stood in for by a ROUTER socket: a
rank's last messages and its close while another of its threads waits in a tray-wide step."""

from __future__ import annotations

import secrets
import sys
import tempfile
import threading
import time
import types

import pytest
import zmq

from tray.errors import UsageError, WireError
from tray.handshake import wire
from tray.handshake.client import RendezvousClient
from tray.rank import _report

TOKEN = secrets.token_hex(32)


@pytest.fixture
def head():
    """A ROUTER bound where ranks connect, its endpoint and a directory for error files."""
    with tempfile.TemporaryDirectory(prefix="tray-client-", dir="/tmp") as tmp:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(f"ipc://{tmp}/head")
        try:
            yield sock, f"ipc://{tmp}/head", tmp
        finally:
            sock.close(0)
            ctx.term()


def messages(sock: zmq.Socket, n: int, rank: int = 0, within_s: float = 5.0) -> list[str]:
    """The kinds of the next `n` messages from `rank-<rank>` (heartbeats, from `rank-<rank>.hb`, skipped)."""
    kinds: list[str] = []
    deadline = time.monotonic() + within_s
    while len(kinds) < n and sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        ident, payload = sock.recv_multipart()
        if ident == f"rank-{rank}".encode():
            kinds.append(wire.decode(payload, token=TOKEN).KIND)
    return kinds


def wait_in_step(client: RendezvousClient, ended: list, voted: threading.Event) -> None:
    """Vote in exchange 'a' and wait for its decision; how the wait ended goes to `ended` (the exception, when)."""
    try:
        with client.step("exchange", "a"):
            client.send(wire.Vote(token=TOKEN, rank=client.rank, topic="a", round=1, value=1, wait_s=30.0))
            voted.set()
            client.receive(wire.Decision, 30.0, "decision on exchange 'a'")
    except BaseException as exc:
        ended.append((exc, time.monotonic()))


def test_a_rank_reporting_and_closing_while_another_thread_waits_in_a_step_ends_that_step_first(head, monkeypatch):
    """A thread waits in a step (its vote sent, polling the main socket for the decision) while the rank's main thread
    reports an error and closes: the report and the close used the socket beside the waiting thread's poll (ZeroMQ
    sockets are not thread-safe), and the socket closed under the poll ended it with "Socket operation on non-socket"
    (or worse). Now the waiting step ends first, at once, with a UsageError naming the closing thread, and the report
    follows the vote to the head. Many rounds, the report made at varying points of the waiting thread's start; each
    round a rank of its own (a ROUTER drops a connection whose identity it still holds)."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # _report installs a hook that prints a reported error once
    sock, endpoint, tmp = head
    for i in range(40):
        env = types.SimpleNamespace(token=TOKEN, rank=i, job_dir=tmp)
        client = RendezvousClient(endpoint, TOKEN, i)
        ended: list[tuple[BaseException, float]] = []
        voted = threading.Event()
        waiter = threading.Thread(target=wait_in_step, args=(client, ended, voted), name="waiter")
        waiter.start()
        assert voted.wait(5.0)
        time.sleep((i % 4) * 0.002)  # 0 to 6 ms: the waiter still on its way into the poll, or in it
        t0 = time.monotonic()
        _report(env, "running", client, ValueError("boom"))
        client.close()
        waiter.join(5.0)
        assert not waiter.is_alive(), "the waiting step outlived the rank's close"
        err, t_end = ended[0]
        assert isinstance(err, UsageError), repr(err)
        assert (f"rank {i}: exchange 'a' in thread 'waiter' ended unanswered: thread "
                f"'{threading.current_thread().name}' is closing the rank's tray") in str(err), str(err)
        assert t_end - t0 < 1.0
        got = messages(sock, 2, i)
        assert got == ["vote", "error"], (i, got)


def test_a_step_begun_after_the_last_message_is_refused_and_close_does_not_wait_for_it(head):
    """Once the rank's bye went, a step on another thread is refused at once (UsageError) instead of voting on a socket
    that another thread is closing; close() takes no longer for it."""
    sock, endpoint, _ = head
    client = RendezvousClient(endpoint, TOKEN, 0)
    assert client.send_last(wire.Bye(token=TOKEN, rank=0)) is True
    refused: list[BaseException] = []

    def late() -> None:
        try:
            with client.step("exchange", "b"):
                pass
        except UsageError as exc:
            refused.append(exc)

    t = threading.Thread(target=late, name="late")
    t.start()
    t.join(5.0)
    assert refused and "rank 0: exchange 'b' in thread 'late' was refused: thread" in str(refused[0]), refused
    t0 = time.monotonic()
    client.close()
    assert time.monotonic() - t0 < 1.0
    assert messages(sock, 1) == ["bye"]
    assert client.send_last(wire.Bye(token=TOKEN, rank=0)) is False  # closed: nothing is sent


def test_a_step_that_does_not_let_go_is_named_when_the_last_message_and_the_close_give_up(head, monkeypatch, capfd):
    """A thread holding a step that never returns to its wait (it runs code of its own) cannot be ended by the eventfd:
    the bye is given up after its wait and the close leaves the socket open, each with a line on stderr that names the
    thread and its step (both were silent before)."""
    import tray.handshake.client as client_module

    monkeypatch.setattr(client_module, "LAST_WAIT_S", 0.2)
    _, endpoint, _ = head
    client = RendezvousClient(endpoint, TOKEN, 3)
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with client.step("exchange", "busy"):
            inside.set()
            release.wait(10.0)

    t = threading.Thread(target=hold, name="holder")
    t.start()
    try:
        assert inside.wait(5.0)
        t0 = time.monotonic()
        assert client.send_last(wire.Bye(token=TOKEN, rank=3), wait_s=0.2) is False
        client.close()
        assert time.monotonic() - t0 < 2.0
    finally:
        release.set()
        t.join(5.0)
        client.close()  # the step let go: this close takes the socket and closes it
    err = capfd.readouterr().err
    closing = threading.current_thread().name
    assert (f"tray: rank 3: thread 'holder' did not end its exchange 'busy' within 0.2 s of thread {closing!r} "
            "closing the rank's tray") in err, err
    assert "the rank's last message to the head (bye) is not sent" in err, err
    assert "the connection to the head is left open until the process ends" in err, err


@pytest.mark.parametrize("world_size", [400, 4])
def test_a_rank_of_a_job_of_many_ranks_takes_a_decision_past_one_mib(head, world_size):
    """A decision holds every rank's value: in a job of more than 256 ranks it may take 4 KiB per rank, past the
    1 MiB of any other message, and the rank decodes it within its job's limit; a rank of a small job still refuses
    it."""
    sock, endpoint, _ = head
    client = RendezvousClient(endpoint, TOKEN, 0, world_size)
    try:
        client.send(wire.Vote(token=TOKEN, rank=0, topic="a", round=1, value=1, wait_s=30.0))
        assert messages(sock, 1) == ["vote"]  # the head knows the rank's connection now
        values = ("v" * 3000,) * 400
        data = wire.encode(wire.Decision(token=TOKEN, topic="a", round=1, values=values), wire.job_message_limit(400))
        assert len(data) > wire.MAX_MESSAGE_NBYTES
        sock.send_multipart([b"rank-0", data])
        if world_size == 400:
            assert client.receive(wire.Decision, 10.0, "decision on exchange 'a'").values == values
        else:
            with pytest.raises(WireError, match=f"message of {len(data)} bytes exceeds the limit of 1048576 bytes"):
                client.receive(wire.Decision, 10.0, "decision on exchange 'a'")
    finally:
        client.close()
