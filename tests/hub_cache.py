"""A Hugging Face cache laid out exactly as `huggingface_hub` lays it, built from local folders (the tests never
reach the network): CACHE/models--ORG--NAME/{blobs/<sha256>, snapshots/<commit>/<path> -> ../../blobs/<sha256>,
refs/<ref> = <commit>} (datasets: datasets--ORG--NAME)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def commit_of(text: str) -> str:
    """A 40-hex commit hash derived from `text` (the same folder gets the same commit)."""
    return hashlib.sha1(text.encode()).hexdigest()


def cache_repo(cache: Path, repo_id: str, source: Path, refs: tuple[str, ...] = ("main",), repo_type: str = "model",
               commit: str | None = None, skip: tuple[str, ...] = ()) -> Path:
    """Put every file of `source` (but the names in `skip`) into `cache` as the snapshot of `repo_id` at `commit`
    (default: derived from the repo id), pointed at by each of `refs`; returns the snapshot folder."""
    commit = commit or commit_of(f"{repo_id}:{source}")
    repo = Path(cache) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for path in sorted(p for p in Path(source).rglob("*") if p.is_file()):
        rel = path.relative_to(source)
        if rel.as_posix() in skip or rel.name in skip:
            continue
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
