"""Techniques applied to an unchanged model, one `apply_*` function per module (DESIGN.md order)."""
