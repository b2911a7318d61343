"""Collectives of a group: NCCL on cuda (nccl.py), shared memory on host (host.py)."""
