"""Diagnostics of a training run: gradient numerics (more to come: loss curve, memory, communication)."""
