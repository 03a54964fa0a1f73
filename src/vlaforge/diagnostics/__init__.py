"""Diagnostics, floor 11 (imports `planner` and below): `vlaforge profile` (every checkpointing / offload strategy
measured on the real model, next to the planner's bytes); the run diagnosis comes here next."""
