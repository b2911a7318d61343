"""Offer/Table wire format, rendezvous client, fd passing."""

# NOTE: a rank's heartbeat period (the client sends, the head expects): every 0.5 s lets the head declare a rank
# dead after a few seconds without costing the rank anything measurable. Here, so the head needs no zmq to know it.
HEARTBEAT_INTERVAL_S = 0.5

# NOTE: the signal that makes a rank write every thread's Python stack to its stderr (faulthandler, registered by
# the rank before it first reaches the head): the head sends it to a rank that keeps a barrier waiting while it
# heartbeats, so the report shows where it is. A real-time signal: programs rarely use one, and the ranks that
# reached the head have its handler (a signal sent to a process without one would end it).
STACK_DUMP_SIGNAL_OFFSET = 5  # signal.SIGRTMIN + this
