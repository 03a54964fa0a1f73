"""Data: the typed `Batch` contract at the model boundary, datasets and loaders."""
