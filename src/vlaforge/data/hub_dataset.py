"""A dataset named by its Hub id (`data.path = "lerobot/libero"`), found where LeRobot finds it: `data.root` when
given, else `HF_LEROBOT_HOME/<repo_id>` (default `~/.cache/huggingface/lerobot`, LeRobot's rule). A folder that is
there is read as it is (LeRobot's own downloads land there); a missing one is downloaded as a dataset repo with
`huggingface_hub` (meta/ first, then only the data and video files of `data.episodes` when it names episodes, as
LeRobot does), unless `HF_HUB_OFFLINE` is set. An existing local `data.path` always wins. The commit a download came
from is recorded with the run (`vlaforge.hub.RESOLVED`).
"""

from __future__ import annotations

import os
from pathlib import Path

from vlaforge import hub
from vlaforge.errors import VlaforgeError, first_line

DEFAULT_REVISION = "v3.0"  # LeRobot's codebase version tag, which its datasets carry; else the default branch


def lerobot_home() -> Path:
    """HF_LEROBOT_HOME, else HF_HOME/lerobot (LeRobot's `HF_LEROBOT_HOME`)."""
    if os.environ.get("HF_LEROBOT_HOME"):
        return Path(os.environ["HF_LEROBOT_HOME"]).expanduser()
    return hub.hf_home() / "lerobot"


def dataset_root(data, fetch: bool = True) -> Path:
    """The local folder of `data.path` (a `DataConfig`): a local folder as it is, else the Hub dataset's folder,
    downloaded first where needed and `fetch` (False: where it would be, for callers that read it only if there).

    Raises:
        VlaforgeError: an id that is neither local nor downloadable (offline, unknown, no such revision), or
            `data.episodes` files missing while offline.
    """
    ref = str(data.path)
    if data.root is None and Path(ref).exists():
        return Path(ref)
    found = dataset_id(ref)
    if found is None:
        return Path(ref)  # the reader says the folder does not exist
    hub_id = hub.HubId(found.repo_id, found.revision or data.revision)
    folder = Path(data.root).expanduser() if data.root else lerobot_home() / hub_id.repo_id
    if not fetch:
        return folder
    if not (folder / "meta" / "info.json").is_file():
        _fetch(hub_id, folder, ["meta/**"], ref)
    missing = episode_files(folder, data.episodes, missing_only=True)
    if missing:
        _fetch(hub_id, folder, missing, ref)
    hub.RESOLVED[(ref, "a dataset")] = hub.Resolved("data.path", ref, hub_id.repo_id, "dataset",
                                                    hub_id.revision or DEFAULT_REVISION, _commit(folder), str(folder))
    return folder


def dataset_id(ref: str) -> hub.HubId | None:
    """A dataset's Hub id: org/name[@rev], or a bare name as LeRobot takes one (HF_LEROBOT_HOME/<name>)."""
    import re

    found = hub.parse_id(ref)
    if found is None and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}", ref) and ".." not in ref:
        return hub.HubId(ref)
    return found


def episode_files(folder: Path, episodes: list[int] | None, missing_only: bool = False) -> list[str]:
    """The data and video files (paths relative to `folder`) that hold `episodes` (every episode's, when None);
    `missing_only`: those not on disk. Read from the episode metadata (v3.0) or the path templates (v2.1)."""
    import json

    info = json.loads((folder / "meta" / "info.json").read_text())
    if str(info.get("codebase_version")) == "v3.0":
        files = _v3_files(folder, info, episodes)
    else:
        chunks = int(info.get("chunks_size", 1000))
        indices = episodes if episodes is not None else range(int(info.get("total_episodes", 0)))
        videos = [k for k, v in (info.get("features") or {}).items() if v.get("dtype") == "video"]
        files = {info["data_path"].format(episode_chunk=e // chunks, episode_index=e) for e in indices}
        files |= {info["video_path"].format(episode_chunk=e // chunks, video_key=k, episode_index=e)
                  for e in indices for k in videos}
    return sorted(f for f in files if not (missing_only and (folder / f).is_file()))


def _v3_files(folder: Path, info: dict, episodes: list[int] | None) -> set[str]:
    import pyarrow.parquet as pq

    wanted = None if episodes is None else set(episodes)
    videos = [k for k, v in (info.get("features") or {}).items() if v.get("dtype") == "video"]
    files: set[str] = set()
    for meta in sorted((folder / "meta" / "episodes").glob("*/*.parquet")):
        for row in pq.read_table(meta).to_pylist():
            if wanted is not None and row["episode_index"] not in wanted:
                continue
            files.add(info["data_path"].format(chunk_index=row["data/chunk_index"],
                                               file_index=row["data/file_index"]))
            files |= {info["video_path"].format(video_key=k, chunk_index=row[f"videos/{k}/chunk_index"],
                                                file_index=row[f"videos/{k}/file_index"]) for k in videos}
    return files


def _fetch(hub_id: hub.HubId, folder: Path, patterns: list[str], ref: str) -> None:
    """Download `patterns` of the dataset repo into `folder` (huggingface_hub's progress bars).

    Raises:
        VlaforgeError: offline, or the Hub refused (no such repo or revision, gated, unreachable).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RevisionNotFoundError

    hint = hub.download_hint(hub_id, "dataset", folder)
    if hub.offline():
        what = "is not" if not (folder / "meta").is_dir() else f"lacks {len(patterns)} files of data.episodes in"
        raise VlaforgeError(f"data.path = {ref!r} is not a local folder, and the Hub dataset {hub_id.repo_id} {what} "
                            f"{folder} (HF_LEROBOT_HOME or data.root) while HF_HUB_OFFLINE is set; download it "
                            f"({hint}) or give a dataset folder (`vlaforge data generate --out DIR`)")
    revisions = [hub_id.revision] if hub_id.revision else [DEFAULT_REVISION, None]
    for i, revision in enumerate(revisions):
        try:
            snapshot_download(hub_id.repo_id, repo_type="dataset", revision=revision, local_dir=str(folder),
                              allow_patterns=patterns)
            return
        except RevisionNotFoundError:
            if i + 1 < len(revisions):
                continue  # a dataset without LeRobot's version tag: its default branch
            raise VlaforgeError(f"data.path: the Hub dataset {hub_id.repo_id} has no revision "
                                f"{hub_id.revision!r}; give one it has (data.revision, or {hub_id.repo_id}@REV)"
                                ) from None
        except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
            raise VlaforgeError(f"data.path = {ref!r} is not a local folder, and the Hub dataset {hub_id.repo_id} "
                                f"could not be downloaded ({first_line(exc, 120)}); check the id and the network, "
                                f"or download it where the Hub is reachable: {hint}") from None


def _commit(folder: Path) -> str | None:
    """The commit huggingface_hub recorded for meta/info.json when it downloaded the folder (its local-dir metadata:
    the commit on the first line); None for a folder it did not download (e.g. a dataset written here)."""
    record = folder / ".cache" / "huggingface" / "download" / "meta" / "info.json.metadata"
    try:
        commit = record.read_text().splitlines()[0].strip() if record.is_file() else ""
    except (OSError, IndexError, UnicodeDecodeError):
        commit = ""
    return commit or None
