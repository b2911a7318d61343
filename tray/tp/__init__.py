"""Tensor parallelism on a tray: the TP MLP bench and its rank program."""
