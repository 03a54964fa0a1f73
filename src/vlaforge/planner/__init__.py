"""`vlaforge plan` (in progress): memory and throughput planning for a VLA on a cluster - the GPU catalog,
model-state and activation bytes, and FLOPs per step exist; the search, report and command come next."""
