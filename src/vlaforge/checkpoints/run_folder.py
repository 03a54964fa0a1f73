"""The run folder a new or resumed run writes into: empty, the run it resumes, or one where a run stopped before its
first checkpoint (which the retry may replace). Nothing of an earlier run that saved a checkpoint is overwritten."""

from __future__ import annotations

import os
from pathlib import Path

from vlaforge.errors import VlaforgeError

# what a run writes before its first checkpoint: a folder holding only these (and no checkpoint) is a run that
# stopped before it saved anything, which its retry may replace
BEFORE_FIRST_CHECKPOINT = frozenset({"config.toml", "precision.json", "sources.json", "metrics.jsonl", "tensorboard",
                                     "traces", "oom_snapshot.pickle", "checkpoints"})


def stopped_before_first_checkpoint(run_dir: Path) -> list[Path]:
    """The files of a run that stopped before its first checkpoint (a missing dataset, a crash at step 1), which a
    new run in the same folder replaces; empty when the folder holds anything else, or any checkpoint."""
    entries = list(run_dir.iterdir()) if run_dir.is_dir() else []
    if not entries or any(e.name not in BEFORE_FIRST_CHECKPOINT for e in entries):
        return []
    saved = run_dir / "checkpoints"
    if saved.exists() and (not saved.is_dir() or any(saved.iterdir())):
        return []
    return entries


def check_run_folder(run_dir: Path, resume_from: Path | None) -> None:
    """A new run needs an empty (or missing) folder it can write, or one where a run stopped before its first
    checkpoint (`stopped_before_first_checkpoint`); a resumed run writes into the run it resumes from (or an empty
    folder). Nothing of an earlier run that saved a checkpoint is ever overwritten.

    Raises:
        VlaforgeError: the folder is a file, holds another run, or cannot be written.
    """
    where = f"train.output_dir {run_dir}"
    if run_dir.exists() and not run_dir.is_dir():
        raise VlaforgeError(f"{where} is a file, not a folder; choose another --train.output_dir")
    if run_dir.is_dir() and any(run_dir.iterdir()) and not (resume_from is None
                                                             and stopped_before_first_checkpoint(run_dir)):
        if resume_from is None:
            raise VlaforgeError(f"{where} is not empty (an earlier run's files would be overwritten); choose another "
                                f"--train.output_dir, or continue that run with --resume {run_dir}")
        if run_dir.resolve() not in resume_from.resolve().parents:
            raise VlaforgeError(f"{where} is not empty and is not the run of the resumed checkpoint {resume_from}; "
                                "resume into that run or into an empty --train.output_dir")
    existing = next(p for p in (run_dir, *run_dir.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise VlaforgeError(f"{where}: {existing} is {'not writable' if existing.is_dir() else 'a file'}; choose a "
                            "writable --train.output_dir")


