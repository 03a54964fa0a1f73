"""Data, floor 1 (imports only `errors`, `registry`, `progress`): the typed `Batch` contract at the model
boundary; LeRobotDataset v2.1/v3.0 reading and writing (parquet + mp4); Meta-World generation and its task
registry; training datasets, transforms, tokenizers and loaders. Nothing here knows the config classes: callers pass
plain values (or a config object they read fields from)."""
