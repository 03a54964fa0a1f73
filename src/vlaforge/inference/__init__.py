"""Inference, floor 7 (imports `checkpoints` and below, never `training`, which shares the floor): `PolicyRuntime`
(typed observations in, action chunks out; sessions, frame-feature caches, compiled regions) and `ChunkExecutor`
(receding horizon, asynchronous, temporal ensembling, real-time chunking). Evaluation, serving and exported packages
predict through it."""
