"""A fine-tune normalizes with the policy's own normalization_mapping (pi0.5: QUANTILES) and the dataset's
statistics of that kind, computed as LeRobot computes them where the dataset has none (data/stats.py): checked
against LeRobot 0.6.1 itself (tests/lerobot_env061/fine_tune_batch.py), its statistics functions and the preprocessor
`lerobot-train` builds, on the same frames."""

from __future__ import annotations

import json
from pathlib import Path

import lerobot061 as ref061
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.xdist_group("lerobot061")


@pytest.fixture(scope="module")
def session_root(tmp_path_factory) -> Path:
    return ref061.session_root(tmp_path_factory)


def _lerobot(inputs: dict[str, torch.Tensor], tmp: Path, folder: str = "-", tasks: list[str] = ()) -> dict:
    given = tmp / "inputs.safetensors"
    save_file({k: v.contiguous() for k, v in inputs.items()}, given, metadata={"tasks": json.dumps(list(tasks))})
    ref061.run("fine_tune_batch.py", folder, str(given), str(tmp / "out.safetensors"))
    return load_file(tmp / "out.safetensors")


def test_statistics_are_computed_as_lerobot_computes_them(tmp_path):
    """Quantiles from LeRobot's histogram per episode, count-weighted over episodes (a one-frame episode too)."""
    from vlaforge.data.stats import aggregate, feature_stats

    g = np.random.default_rng(0)
    episodes = [g.normal(size=(n, 3)).astype(np.float32) * [1, 10, 0.01] for n in (40, 7, 1, 23)]
    episodes[1][:, 2] = 0.5  # a constant dimension: a zero-width histogram range
    ours = aggregate([feature_stats(e) for e in episodes])
    theirs = _lerobot({f"episode.action.{i}": torch.from_numpy(e) for i, e in enumerate(episodes)}, tmp_path)
    assert {k.split(".")[-1] for k in theirs} == set(ours)
    for stat, value in ours.items():
        np.testing.assert_allclose(value.reshape(-1), theirs[f"stats.action.{stat}"].numpy().reshape(-1),
                                   rtol=1e-12, atol=0, err_msg=stat)


@pytest.mark.parametrize("quantiles", ["in stats.json", "computed"])
def test_a_pi05_training_batch_is_lerobots_preprocessor_output(quantiles, tmp_path, monkeypatch, session_root):
    """vlaforge's training samples of a pi0.5 fine-tune (normalized state and actions, the state-prompt tokens) equal
    what LeRobot 0.6.1's fine-tuning preprocessor makes of the same frames with the same dataset statistics: from
    meta/stats.json, or (a dataset without quantiles) computed by vlaforge and by LeRobot each."""
    from vlaforge.config.loading import load_config
    from vlaforge.config.shapes import resolve_shapes
    from vlaforge.data.loader import build_data
    from vlaforge.models.build import build_vla

    from fake_lerobot import write_dataset

    monkeypatch.setenv("VLAFORGE_CACHE", str(tmp_path / "cache"))
    out = ref061.policy_folder("pi05", session_root)
    write_dataset(tmp_path / "ds")
    if quantiles == "computed":  # a dataset from before quantile statistics
        path = tmp_path / "ds" / "meta" / "stats.json"
        stats = json.loads(path.read_text())
        path.write_text(json.dumps({k: {s: v for s, v in kinds.items() if not s.startswith("q")}
                                    for k, kinds in stats.items()}))
    lerobot = {"pretrained": str(out / "policy"), **ref061.folder_options(out)}
    cfg, _ = resolve_shapes(load_config("recipes/pi05.toml", {"model": {"lerobot": lerobot},
                                                              "data": {"path": str(tmp_path / "ds")}}))
    model = build_vla(cfg.model, cfg.loss)
    data = build_data(cfg, model)
    assert data.spec.norm_map == {"STATE": "QUANTILES", "ACTION": "QUANTILES"}
    assert any("computed as LeRobot computes them" in n for n in data.notices) == (quantiles == "computed")
    ds, reader = data.dataset, data.dataset.reader
    rows = [0, 7, len(ds) - 1]
    samples = [ds[i] for i in rows]
    chunk = cfg.model.action_chunk
    raw = {"observation.state": torch.from_numpy(reader.columns["observation.state"][rows]),
           "action": torch.stack([torch.from_numpy(_chunk(reader, r, chunk)) for r in rows])}
    for cam in reader.cameras:
        raw[cam] = torch.rand(len(rows), 3, 8, 8)  # images pass the normalizer untouched (VISUAL: IDENTITY)
    if quantiles == "computed":
        raw |= {f"episode.{k}.{e.index}": torch.from_numpy(reader.columns[k][e.start:e.start + e.length])
                for e in reader.episodes for k in ("observation.state", "action")}
    else:
        raw |= {f"stats.{k}.{s}": torch.tensor(v, dtype=torch.float64).reshape(-1)
                for k in ("observation.state", "action") for s, v in reader.stats[k].items()}
    tasks = [reader.tasks[int(ds.task_of_row[i])] for i in rows]
    theirs = _lerobot(raw, tmp_path, str(out / "policy"), tasks)
    torch.testing.assert_close(torch.stack([s.state for s in samples]), theirs["pre.observation.state"],
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.stack([s.actions for s in samples]), theirs["pre.action"], rtol=0, atol=1e-6)
    mask = theirs["pre.observation.language.attention_mask"]
    for k, s in enumerate(samples):
        assert s.instruction_ids[s.instruction_mask].tolist() == \
            theirs["pre.observation.language.tokens"][k][mask[k]].tolist()


def _chunk(reader, row: int, chunk: int) -> np.ndarray:
    """The raw action chunk from `row`, the episode's last action repeated past its end (LeRobot's padding)."""
    episode = int(reader.columns["episode_index"][row])
    e = next(x for x in reader.episodes if x.index == episode)
    steps = np.minimum(np.arange(row, row + chunk), e.start + e.length - 1)
    return reader.columns["action"][steps]
