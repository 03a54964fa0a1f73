"""`vlaforge plan`: memory and throughput planning for a model on a cluster (in progress: hardware catalog and model-state memory)."""
