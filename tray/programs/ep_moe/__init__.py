"""Expert-parallel MoE on a tray: routing plans (plan.py), host twins (twins.py), rank program, bench."""
