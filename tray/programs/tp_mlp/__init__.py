"""Tensor parallelism on a tray: the TP MLP, its host twin (twins.py), rank program and bench."""
