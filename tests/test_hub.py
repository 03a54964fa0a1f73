"""Hub ids wherever vlaforge takes a folder (vlaforge/hub.py, data/hub_dataset.py), against a cache laid out as
huggingface_hub lays it (tests/hub_cache.py) and HF_LEROBOT_HOME datasets; offline throughout (tests/conftest.py
sets HF_HUB_OFFLINE). The policy-level checks (a SmolVLA / pi0 folder by id, its own references resolved) are in
tests/test_lerobot_train.py beside the `lerobot-train` command lines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hub_cache import cache_repo, commit_of

from vlaforge import hub
from vlaforge.errors import VlaforgeError


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache (HF_HUB_CACHE) and LeRobot home (HF_LEROBOT_HOME) for this test."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_LEROBOT_HOME", str(tmp_path / "lerobot"))
    monkeypatch.setattr(hub, "RESOLVED", {})
    return tmp_path / "hub"


def _folder(tmp_path: Path, name: str = "src", files=("config.json", "model.safetensors")) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    for f in files:
        (folder / f).write_text(f"{{\"file\": \"{f}\"}}")
    return folder


def test_an_id_resolves_to_its_snapshot_at_each_revision(tmp_path, cache):
    """org/name, org/name@tag and org/name@commit resolve to the cached snapshot; the commit is recorded."""
    snap = cache_repo(cache, "org/policy", _folder(tmp_path), refs=("main", "v1"))
    commit = snap.name
    for ref in ("org/policy", "org/policy@v1", f"org/policy@{commit}"):
        assert hub.local_folder(ref, "model.lerobot.pretrained", hub.POLICY) == snap
    recorded = {r["ref"]: r for r in hub.resolved_sources()}
    assert recorded["org/policy"]["commit"] == commit and recorded["org/policy@v1"]["revision"] == "v1"


def test_a_local_folder_wins_over_an_id(tmp_path, cache, monkeypatch):
    cache_repo(cache, "org/policy", _folder(tmp_path))
    local = tmp_path / "work" / "org" / "policy"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    assert hub.local_folder("org/policy", "f", hub.POLICY) == Path("org/policy")


@pytest.mark.parametrize("ref", ["org/", "a/b/c", "../x", "org/..", "org/na me", "/no/such/folder", "bare",
                                 "org/x@../../etc", "org--x/y"])
def test_malformed_ids_are_refused(ref, cache):
    with pytest.raises(VlaforgeError, match="neither an existing folder nor a Hub id"):
        hub.local_folder(ref, "model.lerobot.pretrained", hub.POLICY)


def test_what_the_cache_cannot_give_is_refused_in_one_line(tmp_path, cache):
    """Not cached while offline, an unknown revision, a snapshot missing a needed file, a link out of the cache."""
    cache_repo(cache, "org/partial", _folder(tmp_path, "p", files=("config.json",)))
    snap = cache_repo(cache, "org/escape", _folder(tmp_path, "e"))
    outside = tmp_path / "secret.json"
    outside.write_text("{}")
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to(outside)
    cases = {"org/absent": "not in the Hugging Face cache .* HF_HUB_OFFLINE is set; download it .*: "
                           "hf download org/absent$",
             "org/partial@nope": "hf download org/partial --revision nope",
             "org/partial": "has no model.safetensors, which a LeRobot policy needs; download it again",
             "org/escape": "links to .*secret.json, outside the cache"}
    for ref, pattern in cases.items():
        with pytest.raises(VlaforgeError, match=pattern) as err:
            hub.local_folder(ref, "model.lerobot.pretrained", hub.POLICY)
        assert "\n" not in str(err.value)
    assert hub.local_folder("org/partial", "x", hub.POLICY_CONFIG).name == commit_of(
        f"org/partial:{tmp_path / 'p'}")  # what planning reads is there


def test_a_tokenizer_needs_its_files_only(tmp_path, cache):
    cache_repo(cache, "google/tok", _folder(tmp_path, "t", files=("tokenizer.json", "tokenizer_config.json")))
    assert (hub.local_folder("google/tok", "f", hub.TOKENIZER) / "tokenizer.json").is_file()
    cache_repo(cache, "google/none", _folder(tmp_path, "n", files=("config.json",)))
    with pytest.raises(VlaforgeError, match="has no tokenizer.json or tokenizer.model or tokenizer_config.json"):
        hub.local_folder("google/none", "f", hub.TOKENIZER)


# ---- datasets: LeRobot's HF_LEROBOT_HOME rule, data.root, data.episodes ------------------------------------------

def _dataset(root: Path) -> Path:
    from fake_lerobot import write_dataset

    write_dataset(root, data_file_mb=1e-6, video_file_mb=1e-6)  # one data / video file per episode
    return root


def _data(**kw):
    from vlaforge.config.run import DataConfig

    return DataConfig(source="lerobot", **kw)


def test_a_dataset_id_is_found_where_lerobot_puts_it(tmp_path, cache):
    from vlaforge.data.hub_dataset import dataset_root, lerobot_home
    from vlaforge.data.lerobot_v3 import LeRobotDataset

    _dataset(lerobot_home() / "org" / "demo")
    assert dataset_root(_data(path="org/demo")) == lerobot_home() / "org" / "demo"
    _dataset(tmp_path / "elsewhere")
    assert dataset_root(_data(path="org/demo", root=str(tmp_path / "elsewhere"))) == tmp_path / "elsewhere"
    reader = LeRobotDataset(dataset_root(_data(path="org/demo")), episodes=[0, 2])
    assert [e.index for e in reader.episodes] == [0, 2]
    assert len(reader.columns["index"]) == 7 + 5 and reader.episodes[1].start == 7
    assert set(reader.columns["episode_index"].tolist()) == {0, 2}
    full = LeRobotDataset(lerobot_home() / "org" / "demo")
    np.testing.assert_array_equal(reader.columns["action"][7:], full.columns["action"][19:])
    with pytest.raises(VlaforgeError, match="data.episodes asks for episode 9, which dataset .* does not have"):
        LeRobotDataset(lerobot_home() / "org" / "demo", episodes=[9])


def test_a_missing_dataset_offline_is_refused_with_the_download_command(cache):
    from vlaforge.data.hub_dataset import dataset_root, lerobot_home

    with pytest.raises(VlaforgeError, match=r"hf download lerobot/libero --repo-type dataset --revision v2 "
                                            rf"--local-dir {lerobot_home() / 'lerobot/libero'}"):
        dataset_root(_data(path="lerobot/libero@v2"))


def test_only_the_asked_episodes_are_downloaded(tmp_path, cache, monkeypatch):
    """Online, a dataset id downloads meta/ first, then only the data and video files of data.episodes (as
    LeRobot's download does); huggingface_hub's snapshot_download is replaced by a copy from a local 'Hub'."""
    import fnmatch
    import shutil

    import huggingface_hub

    from vlaforge.data.hub_dataset import dataset_root, lerobot_home

    remote = _dataset(tmp_path / "remote")
    calls = []

    def fake_download(repo_id, *, repo_type, revision, local_dir, allow_patterns):
        calls.append((repo_id, repo_type, revision, sorted(allow_patterns)))
        for path in remote.rglob("*"):
            rel = path.relative_to(remote).as_posix()
            if path.is_file() and any(fnmatch.fnmatch(rel, p) for p in allow_patterns):
                (Path(local_dir) / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, Path(local_dir) / rel)
        return local_dir

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)  # (an earlier test of this process may set it)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    folder = dataset_root(_data(path="org/remote", episodes=[1]))
    assert folder == lerobot_home() / "org" / "remote"
    assert calls[0] == ("org/remote", "dataset", "v3.0", ["meta/**"])
    fetched = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
                     and not p.relative_to(folder).as_posix().startswith("meta/"))
    assert fetched == calls[1][3] and len(fetched) == 3  # episode 1's data file and its two cameras' videos
    assert all("file-001" in f for f in fetched), fetched


def test_sources_are_written_with_the_run(tmp_path, cache):
    """A run reading a dataset by id writes sources.json naming it (no commit: it was not downloaded here)."""
    import json

    from vlaforge.data.hub_dataset import lerobot_home

    from conftest import train_on_dataset

    _dataset(lerobot_home() / "org" / "demo")
    (tmp_path / "ds").mkdir()  # (train_on_dataset's own data.path, replaced by the id)
    run = train_on_dataset(tmp_path, "run", "--data.path=org/demo", "--data.episodes=[0, 1]", steps=1)
    sources = json.loads((run / "sources.json").read_text())
    assert sources == [{"field": "data.path", "ref": "org/demo", "repo_id": "org/demo", "repo_type": "dataset",
                        "revision": "v3.0", "commit": None, "path": str(lerobot_home() / "org" / "demo")}]


def test_pretrained_backbones_take_hub_ids(tmp_path, cache):
    """model.llm.pretrained and model.vision.pretrained as Hub ids: the model builds from the cached snapshots, as
    from the folders themselves (the same weights), and the LLM's tokenizer comes from its snapshot."""
    from vlaforge.data.tokenizer import pretrained_tokenizer
    from vlaforge.models.build import build_vla

    from conftest import tiny_config
    from families import build_family, build_tower

    llm, tower = build_family("llama", tmp_path / "llama"), build_tower("siglip", tmp_path / "siglip")
    cache_repo(cache, "org/tiny-llama", llm)
    cache_repo(cache, "org/tiny-siglip", tower)
    by_id = tiny_config(tmp_path, model={"llm": {"pretrained": "org/tiny-llama"},
                                         "vision": {"pretrained": "org/tiny-siglip@main"}})
    by_path = tiny_config(tmp_path, model={"llm": {"pretrained": str(llm)}, "vision": {"pretrained": str(tower)}})
    a, b = build_vla(by_id.model, by_id.loss), build_vla(by_path.model, by_path.loss)
    ours, theirs = a.state_dict(), b.state_dict()
    for comp in ("llm", "vision"):
        names = [n for n in theirs if n.startswith(comp + ".")]
        assert names and all(torch.equal(ours[n], theirs[n]) for n in names), comp
    assert pretrained_tokenizer("org/tiny-llama").ids("open the door") == \
        pretrained_tokenizer(str(llm)).ids("open the door")
    assert {r["ref"] for r in hub.resolved_sources()} >= {"org/tiny-llama", "org/tiny-siglip@main"}
