"""Expert-parallel MoE on a tray: routing plans (plan.py), the rank program and the bench (bench.py)."""
