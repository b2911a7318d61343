"""Offer/Table wire format, rendezvous client, fd passing."""

# NOTE: a rank's heartbeat period (the client sends, the head expects): every 0.5 s lets the head declare a rank
# dead after a few seconds without costing the rank anything measurable. Here, so the head needs no zmq to know it.
HEARTBEAT_INTERVAL_S = 0.5

# NOTE: the signal that makes a rank write every thread's Python stack to its stderr (faulthandler, registered by
# the rank before it first reaches the head): the head sends it to a rank that keeps a barrier waiting while it
# heartbeats, so the report shows where it is. A real-time signal: programs rarely use one, and the ranks that
# reached the head have its handler (a signal sent to a process without one would end it).
STACK_DUMP_SIGNAL_OFFSET = 5  # signal.SIGRTMIN + this


def raise_fd_soft_limit(need: int | None = None) -> tuple[int, int]:
    """Raise this process's soft open-file limit to `need` (None: to the hard limit) when it is lower, up to the
    hard limit; (soft, hard) after. fd passing needs room for every fd a reply brings: the head and the root for
    their sockets, a rank for its own exported buffers and, while it maps them, a peer's."""
    import contextlib
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if need is None else (need if hard == resource.RLIM_INFINITY else min(need, hard))
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)
