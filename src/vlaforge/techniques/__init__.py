"""Techniques, floor 4 (imports `models` and below): one `apply_*` per module applied to an unchanged model -
precision and fp8, activation checkpointing, activation offload, freezing, per-block compile - and the saved-bytes
accounting they report into (`accounting.py`)."""
