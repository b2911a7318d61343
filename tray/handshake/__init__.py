"""Offer/Table wire format, rendezvous client, fd passing."""

# NOTE: a rank's heartbeat period (the client sends, the head expects): every 0.5 s lets the head declare a rank
# dead after a few seconds without costing the rank anything measurable. Here, so the head needs no zmq to know it.
HEARTBEAT_INTERVAL_S = 0.5
