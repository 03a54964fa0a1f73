"""LeRobot 0.6.1's training batch for a fine-tune: the preprocessor `lerobot-train` builds from a pretrained policy
folder (`make_pre_post_processors(..., pretrained_path=DIR)` with its overrides: the dataset's statistics in the
normalizer, the policy's features and normalization_mapping), run over raw frames; and LeRobot's own statistics of
state and action where the dataset has none (`get_feature_stats` per episode, then `aggregate_stats`, as
`augment_dataset_quantile_stats.py` computes them).

usage: PYTHONPATH=.venv/lerobot061:tests/lerobot_env061 python tests/lerobot_env061/fine_tune_batch.py DIR INPUTS OUT

INPUTS (safetensors): observation.images.<cam> (B,3,H,W) in [0,1], observation.state (B,S), action (B,T,A) raw;
  either stats.<feature>.<stat> (the dataset's meta/stats.json) or episode.<feature>.<i> (each episode's rows, for
  LeRobot to compute the statistics); metadata {"tasks": json list of B strings}.
OUT (safetensors): pre.<key> every tensor the preprocessor returns; stats.<feature>.<stat> the statistics it used.
DIR "-": the statistics only (INPUTS holds episode.* alone).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def _compute_stats():
    """LeRobot's `datasets/compute_stats.py`, imported without the `lerobot.datasets` package's __init__ (which needs
    Hugging Face `datasets`, not in this site): the package stands in as a bare namespace, and `io_utils` (image
    reading, unused for vectors) as an empty module."""
    import importlib
    import types

    import lerobot

    package = types.ModuleType("lerobot.datasets")
    package.__path__ = [str(Path(lerobot.__file__).parent / "datasets")]
    sys.modules.setdefault("lerobot.datasets", package)
    io_utils = types.ModuleType("lerobot.datasets.io_utils")
    io_utils.load_image_as_numpy = None
    sys.modules.setdefault("lerobot.datasets.io_utils", io_utils)
    return importlib.import_module("lerobot.datasets.compute_stats")


def lerobot_stats(inputs: dict[str, torch.Tensor]) -> dict[str, dict[str, np.ndarray]]:
    """The statistics given (stats.*), else computed by LeRobot's own functions over the episodes (episode.*)."""

    given: dict[str, dict[str, np.ndarray]] = {}
    for name, value in inputs.items():
        if name.startswith("stats."):
            feature, stat = name[len("stats."):].rsplit(".", 1)
            given.setdefault(feature, {})[stat] = value.numpy()
    if given:
        return given
    episodes: dict[int, dict[str, np.ndarray]] = {}
    for name, value in inputs.items():
        if name.startswith("episode."):
            feature, index = name[len("episode."):].rsplit(".", 1)
            episodes.setdefault(int(index), {})[feature] = value.numpy()
    cs = _compute_stats()
    per_episode = [{k: cs.get_feature_stats(v, axis=0, keepdims=v.ndim == 1, quantile_list=cs.DEFAULT_QUANTILES)
                    for k, v in episodes[i].items()} for i in sorted(episodes)]
    return cs.aggregate_stats(per_episode)


def run(policy_dir: Path, inputs_path: Path, out_path: Path) -> None:
    from lerobot.configs import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors

    inputs = load_file(inputs_path)
    stats = lerobot_stats(inputs)
    saved = {f"stats.{f}.{s}": torch.as_tensor(np.asarray(v, np.float64)) for f, kinds in stats.items()
             for s, v in kinds.items()}
    if policy_dir.name == "-":
        save_file(saved, out_path)
        return
    cfg = PreTrainedConfig.from_pretrained(policy_dir)
    with safe_open(inputs_path, "pt") as f:
        tasks = json.loads(f.metadata()["tasks"])
    batch = {k: v for k, v in inputs.items() if not k.startswith(("stats.", "episode."))}
    from lerobot.configs.types import FeatureType, PolicyFeature

    # the features lerobot-train's make_policy sets from the dataset (its cameras, state and action sizes)
    cams = [k for k in batch if k.startswith("observation.images.")]
    cfg.input_features = {c: PolicyFeature(type=FeatureType.VISUAL, shape=tuple(batch[c].shape[1:])) for c in cams}
    cfg.input_features["observation.state"] = PolicyFeature(type=FeatureType.STATE,
                                                            shape=(batch["observation.state"].shape[1],))
    cfg.output_features = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(batch["action"].shape[-1],))}
    overrides = {"device_processor": {"device": "cpu"},
                 "normalizer_processor": {"stats": stats, "features": {**cfg.input_features, **cfg.output_features},
                                          "norm_map": cfg.normalization_mapping},
                 "rename_observations_processor": {"rename_map": {}}}
    pre, _ = make_pre_post_processors(cfg, pretrained_path=str(policy_dir), dataset_stats=stats,
                                      preprocessor_overrides=overrides)
    out = pre({**batch, "task": tasks})
    saved |= {f"pre.{k}": v.detach().contiguous() for k, v in out.items() if isinstance(v, torch.Tensor)}
    save_file(saved, out_path)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    run(Path(sys.argv[1]) if sys.argv[1] == "-" else Path(sys.argv[1]).resolve(), Path(sys.argv[2]),
        Path(sys.argv[3]))
