"""Diagnostics, floor 11 (imports `planner` and below): `vlaforge profile` (every checkpointing / offload strategy
measured on the real model, next to the planner's bytes) and `vlaforge diagnose` (a run's recorded signals read into
ranked findings with fixes, a checklist and an HTML report)."""
