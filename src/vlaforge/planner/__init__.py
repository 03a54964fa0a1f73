"""`vlaforge plan`, floor 10 (imports `evaluation` and below): the GPU catalog, model-state and activation bytes,
FLOPs and step time, the layout search that uses the trainer's own checks, reports and the white paper."""
