"""Output folders a command may replace: only the ones it wrote itself, proven by content.

A command that writes a folder (`vlaforge export --format onnx|executorch`, `vlaforge quantize`) builds it under a
temporary name, stamps it with `.vlaforge-owner.json` (the command and the sha256 of every file it wrote), and renames
it into place. Writing to the same `--out` again replaces the folder only when every file in it is one the stamp lists,
unchanged: a folder with anything else in it, or without a stamp, is refused in one line and left as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from vlaforge.errors import VlaforgeError

OWNER_FILE = ".vlaforge-owner.json"


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> dict[str, Path]:
    """Every entry under `folder` but the stamp, by relative path (folders and links count: they are not ours)."""
    return {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*"))
            if p.name != OWNER_FILE or p.parent != folder}


def stamp(folder: Path, command: str) -> None:
    """Write the ownership stamp of `folder` (call it last, on the temporary folder, before the rename)."""
    files = {name: file_sha256(p) for name, p in _files(folder).items() if p.is_file()}
    (folder / OWNER_FILE).write_text(json.dumps({"command": command, "sha256": files}, indent=1) + "\n")


def check_replaceable(out: Path, command: str, folders: tuple[str, ...] = ()) -> None:
    """`out` may be written by `command`: it does not exist, or it is a folder `command` wrote, unchanged since.
    `folders`: the sub-folders `command` writes (every file in them listed by the stamp, like the others).

    Raises:
        VlaforgeError: one line naming what is in the way (a file, a folder without the stamp, a file the stamp
            does not list or whose content changed).
    """
    if not out.exists() and not out.is_symlink():
        return
    fix = "remove it or choose a new folder"
    if not out.is_dir() or out.is_symlink():
        raise VlaforgeError(f"--out {out} exists and is not a folder `{command}` wrote; {fix}")
    try:
        owner = json.loads((out / OWNER_FILE).read_text())
        listed = owner["sha256"] if owner.get("command") == command else None
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        listed = None
    if not isinstance(listed, dict):  # NOTE: a plain check, not an assert (python -O strips those)
        raise VlaforgeError(f"--out {out} exists and was not written by `{command}` (it has no {OWNER_FILE} of "
                            f"that command); {fix}")
    for name, path in _files(out).items():
        if name in folders and path.is_dir() and not path.is_symlink():
            continue
        if not path.is_file() or path.is_symlink() or name not in listed:
            raise VlaforgeError(f"--out {out} holds {name}, which `{command}` did not write; {fix}")
        if file_sha256(path) != listed[name]:
            raise VlaforgeError(f"--out {out}: {name} changed since `{command}` wrote it; {fix}")


def replace_folder(tmp: Path, out: Path) -> None:
    """Move the finished folder `tmp` to `out`, replacing the old `out` (checked by `check_replaceable`): the old
    one is set aside first and removed only after the new one is in place."""
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
