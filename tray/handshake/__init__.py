"""Offer/Table wire format, rendezvous client, fd passing."""
