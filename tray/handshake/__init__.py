"""Offer/Table wire format, rendezvous client, fd passing."""

# a rank's heartbeat period (the client sends, the head expects); here so the head needs no zmq to know it
HEARTBEAT_INTERVAL_S = 0.5
