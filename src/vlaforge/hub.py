"""Hugging Face Hub ids wherever vlaforge takes a folder: `org/name` (optionally `@revision`) resolves through
`huggingface_hub` itself, as LeRobot and transformers resolve it - the local cache first (`HF_HUB_CACHE`, else
`HF_HOME/hub`), a download of only the files needed (with huggingface_hub's progress bars) when online,
`HF_HUB_OFFLINE=1` honoured. Datasets follow LeRobot's rule: `HF_LEROBOT_HOME/<repo_id>` (default
`~/.cache/huggingface/lerobot`) or an explicit root (`data/hub_data.py`). An existing local folder always wins.

Every resolution is recorded (`RESOLVED`: the id, the revision asked for, the commit it resolved to, the folder),
so a run can write down what it read (`sources.json`). Bad ids, a missing revision, a snapshot missing a file, or a
cache entry whose link leaves the cache are refused in one line naming the id and what to do (`hf download ...`).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from vlaforge.errors import VlaforgeError, first_line

# org/name as the Hub allows them (huggingface_hub's validate_repo_id), and a revision: a branch, tag or commit
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?:@(?P<rev>[A-Za-z0-9._/-]{{1,255}}))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Files:
    """What a resolution downloads (`patterns`: huggingface_hub's allow_patterns) and what must be there after it:
    every name of `required`, and at least one of each group of `one_of`."""

    what: str  # "a LeRobot policy", "a tokenizer", ... (for messages)
    patterns: tuple[str, ...]
    required: tuple[str, ...] = ()
    one_of: tuple[tuple[str, ...], ...] = ()


_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "*.model", "vocab*", "merges.txt",
                    "chat_template*")
# a LeRobot policy folder: config, weights, both processor pipelines and their state files (and the card)
POLICY = Files("a LeRobot policy", ("*.json", "*.safetensors", "*.md"), ("config.json", "model.safetensors"))
# what planning and config checks read of a policy: its config.json (and pipelines), no weights
POLICY_CONFIG = Files("a LeRobot policy's config", ("*.json",), ("config.json",))
# a tokenizer a processor step names (pi0's google/paligemma-3b-pt-224): tokenizer files only, never the weights
TOKENIZER = Files("a tokenizer", (*_TOKENIZER_FILES, "config.json"),
                  one_of=(("tokenizer.json", "tokenizer.model", "tokenizer_config.json"),))
# SmolVLA's VLM (vlm_model_name): its config, processor and tokenizer; the weights come from the policy's file
VLM_CONFIG = Files("a VLM's config and tokenizer", ("*.json", *_TOKENIZER_FILES), ("config.json",))
# what a fake (planning) build reads of a pretrained model: its config files
MODEL_CONFIG = Files("a model's config", ("*.json",), ("config.json",))
# a pretrained tower, LLM or VLM (model.{vision,llm,vlm}.pretrained): config, weights, tokenizer and processor
PRETRAINED = Files("a pretrained model", ("*.json", "*.safetensors", *_TOKENIZER_FILES), ("config.json",),
                   one_of=(("model.safetensors", "model.safetensors.index.json"),))


@dataclass(frozen=True)
class HubId:
    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class Resolved:
    """One id resolved: what was asked, the commit it is, the local folder read."""

    field: str
    ref: str
    repo_id: str
    repo_type: str
    revision: str
    commit: str | None
    path: str


RESOLVED: dict[tuple[str, str], Resolved] = {}  # (ref, files.what) -> resolution, for the run's sources.json


def resolved_sources() -> list[dict]:
    """What this process resolved so far, as JSON-ready dicts (the run writes them to sources.json)."""
    return [asdict(r) for r in RESOLVED.values()]


def parse_id(text: str) -> HubId | None:
    """`org/name[@revision]` -> HubId; None where `text` is not shaped like a Hub id (a path, a bare name)."""
    found = _ID.match(str(text))
    if not found or ".." in found.group("repo") or "--" in found.group("repo") or ".." in (found.group("rev") or ""):
        return None
    return HubId(found.group("repo"), found.group("rev"))


def looks_like_id(text: str) -> bool:
    """Shaped like `org/name[@rev]` and not an existing local path: what `local_folder` would send to the Hub."""
    return not Path(str(text)).exists() and parse_id(text) is not None


def hub_cache() -> Path:
    """huggingface_hub's cache folder, read from the environment now (its constants are read once, at import)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    return hf_home() / "hub"


def hf_home() -> Path:
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "huggingface"


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set: nothing is downloaded, only the cache is read."""
    return any(os.environ.get(n, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for n in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def local_folder(ref: str | Path, field: str, files: Files, revision: str | None = None, instead: str = "") -> Path:
    """The local folder `ref` names: an existing path as it is, else a Hub id resolved to its cached (or downloaded)
    snapshot. `field` names the setting in messages; `revision` applies where `ref` carries none; `instead` ends a
    refusal with another way out (", or set model.lerobot.vlm to a local copy").

    Raises:
        VlaforgeError: `ref` is neither an existing path nor a valid id; the id cannot be resolved offline, has no
            such revision, misses a file `files` requires, or its cache entry links outside the cache.
    """
    text = str(ref)
    if Path(text).exists():
        return Path(text)
    hub = parse_id(text)
    if hub is None:
        shape = "a Hub id (org/name[@revision])"
        raise VlaforgeError(f"{field} = {text!r} is neither an existing folder nor {shape}; give a local folder "
                            "or a Hub id such as lerobot/smolvla_base")
    hub = HubId(hub.repo_id, hub.revision or revision)
    key = (text, files.what)
    if key in RESOLVED and Path(RESOLVED[key].path).is_dir():
        return Path(RESOLVED[key].path)
    try:
        path = _snapshot(hub, field, files)
    except VlaforgeError as exc:
        raise VlaforgeError(f"{exc}{instead}") from None
    RESOLVED[key] = Resolved(field, text, hub.repo_id, "model", hub.revision or "main", _commit_of(path), str(path))
    return path


def download_hint(hub: HubId, repo_type: str = "model", local_dir: Path | None = None) -> str:
    """The `hf download` command that puts `hub` where vlaforge looks for it."""
    rev = f" --revision {hub.revision}" if hub.revision else ""
    kind = f" --repo-type {repo_type}" if repo_type != "model" else ""
    where = f" --local-dir {local_dir}" if local_dir is not None else ""
    return f"hf download {hub.repo_id}{kind}{rev}{where}"


def _snapshot(hub: HubId, field: str, files: Files) -> Path:
    """The snapshot folder of `hub` in the cache, downloaded first where it is missing and the Hub may be reached."""
    cache = hub_cache()
    path = _cached(hub, cache, files)
    if path is None:
        if offline():
            raise VlaforgeError(f"{field}: {hub} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is "
                                f"set; download it where the Hub is reachable: {download_hint(hub)}")
        path = _download(hub, cache, files, field)
    check_inside(path, cache, hub, field)
    missing = _missing(path, files)
    if missing:
        raise VlaforgeError(f"{field}: the cached snapshot of {hub} ({path}) has no {missing}, which {files.what} "
                            f"needs; download it again: {download_hint(hub)}")
    return path


def _cached(hub: HubId, cache: Path, files: Files) -> Path | None:
    """The snapshot folder the cache holds for `hub` (its ref or commit), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=str(cache),
                                      allow_patterns=list(files.patterns), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        return None
    except Exception as exc:
        if type(exc).__name__ != "IncompleteSnapshotError":
            raise
        return None
    return path if _missing(path, files) == "" or offline() else None


def _download(hub: HubId, cache: Path, files: Files, field: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=str(cache),
                                      allow_patterns=list(files.patterns)))
    except RevisionNotFoundError:
        raise VlaforgeError(f"{field}: {hub.repo_id} has no revision {hub.revision!r}; give a branch, tag or "
                            "commit it has (org/name@revision)") from None
    except GatedRepoError:
        raise VlaforgeError(f"{field}: {hub.repo_id} is gated; accept its terms on huggingface.co and log in "
                            "(hf auth login), then run again") from None
    except RepositoryNotFoundError:
        raise VlaforgeError(f"{field}: no Hub repository {hub.repo_id} (or it is private: hf auth login); check "
                            "the id") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise VlaforgeError(f"{field}: {hub} could not be downloaded ({first_line(exc, 120)}); check the network, "
                            f"or download it where the Hub is reachable: {download_hint(hub)}") from None


def _missing(path: Path, files: Files) -> str:
    """The first required file (or group of alternatives) `path` lacks, or ''."""
    for name in files.required:
        if not (path / name).is_file():
            return name
    for group in files.one_of:
        if not any((path / name).is_file() for name in group):
            return " or ".join(group)
    return ""


def check_inside(path: Path, cache: Path, hub: HubId, field: str) -> None:
    """Every file of a cached snapshot must resolve inside the cache (huggingface_hub links snapshots to blobs in
    the same repo folder); a link that leaves it is someone else's file, refused.

    Raises:
        VlaforgeError: naming the entry and where it points.
    """
    root = cache.resolve()
    for entry in [path, *path.rglob("*")]:
        target = entry.resolve()
        if not target.is_relative_to(root):
            raise VlaforgeError(f"{field}: {entry} in the cached snapshot of {hub} links to {target}, outside the "
                                f"cache {cache}; remove the entry and download it again: {download_hint(hub)}")


def _commit_of(path: Path) -> str | None:
    """The commit a cache snapshot folder is (snapshots/<commit>)."""
    return path.name if _COMMIT.match(path.name) and path.parent.name == "snapshots" else None
