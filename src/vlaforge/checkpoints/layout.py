"""A checkpoint folder's layout and the one resolver every verb calls: which folder a path names (a run folder, its
`checkpoints/latest`, a `checkpoints/step_*` folder), which run a checkpoint belongs to, and `latest` kept on a
complete checkpoint at every instant while a save replaces one (also after a save was killed).

Layout: RUN_DIR/checkpoints/step_00000010/{model.safetensors, trainer_state.pt, config.toml[, policy.json,
tokenizer.json, backbones.json, lora.json]}, RUN_DIR/checkpoints/latest. A sharded checkpoint
(`train.checkpoint_format = "sharded"`) has `dcp/` (torch.distributed.checkpoint: every rank's shards of model and
optimizer) instead of model.safetensors, and no optimizer in trainer_state.pt; `vlaforge export` writes its
model.safetensors.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from vlaforge.errors import VlaforgeError
from vlaforge.outputs import write_atomic

MODEL_FILE, STATE_FILE, CONFIG_FILE, DCP_DIR = "model.safetensors", "trainer_state.pt", "config.toml", "dcp"


def is_sharded(ckpt: Path) -> bool:
    """A sharded (DCP) checkpoint: training resumes from its shards (model.safetensors, once exported, is for
    inference)."""
    return (ckpt / DCP_DIR / ".metadata").is_file()


def has_weights(ckpt: Path) -> bool:
    return (ckpt / MODEL_FILE).is_file() or is_sharded(ckpt)


def temporary_folder(run_dir: Path, step: int) -> Path:
    """Where checkpoint `step` is written before the rename (the same path on every rank)."""
    return run_dir / "checkpoints" / f".step_{step:08d}.tmp"


def finish_interrupted_saves(root: Path, keep: Path | None = None) -> None:
    """What killed saves left in `root` (a run's checkpoints/), put right, keeping `latest` on a complete checkpoint
    at every instant. A save killed after `latest` moved to the aside copy .step_X.old (so its .step_X.tmp is
    complete) is finished: the new folder renamed into place, `latest` pointed at it, the aside copy removed. A
    .step_X.tmp saved no further is removed (but `keep`, the folder the current save's ranks are writing)."""
    latest = root / "latest"
    named = lambda: latest.read_text().strip() if latest.is_file() else ""
    for tmp in sorted(root.glob(".step_*.tmp")):
        name = tmp.name[1:-len(".tmp")]
        if tmp == keep or not tmp.is_dir():
            continue
        if named() == f".{name}.old":  # past the commit point: `latest` holds the old copy meanwhile
            shutil.rmtree(root / name, ignore_errors=True)
            tmp.rename(root / name)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    for aside in sorted(root.glob(".step_*.old")):
        name, holds = aside.name[1:-len(".old")], named() == aside.name
        if holds and not (root / name).exists():
            aside.rename(root / name)  # the only copy left
        if holds:
            write_atomic(latest, name + "\n")
        shutil.rmtree(aside, ignore_errors=True)


def _pause(stage: str) -> None:
    """Between the steps of replacing a checkpoint; tests make it wait, to kill the process there."""


def move_into_place(tmp: Path, final: Path) -> None:
    """Rename the complete checkpoint `tmp` to `final` and point `latest` at it. `latest` names a complete
    checkpoint at every instant, also when `final` already exists (the same step saved again): the old one is first
    linked aside (hard links: no bytes copied) and `latest` moved there, before it is removed."""
    latest, aside = final.parent / "latest", final.parent / f".{final.name}.old"
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        shutil.copytree(final, aside, copy_function=os.link)
        write_atomic(latest, aside.name + "\n")
        _pause("aside")
        shutil.rmtree(final)
        _pause("removed")
    tmp.rename(final)
    _pause("renamed")
    write_atomic(latest, final.name + "\n")
    for stale in final.parent.glob(".step_*.old"):  # this one, and any a killed save left
        shutil.rmtree(stale, ignore_errors=True)


def local_checkpoint(path: str | Path, what: str = "CHECKPOINT") -> Path:
    """The local folder a verb's CHECKPOINT argument names: a path as it is, or a Hub id of a LeRobot policy
    (`lerobot/smolvla_base[@rev]`) resolved through the Hugging Face cache (`vlaforge.hub`).

    Raises:
        VlaforgeError: an id that cannot be resolved (offline and not cached, unknown revision, files missing).
    """
    from vlaforge import hub

    return hub.local_folder(path, what, hub.POLICY) if hub.looks_like_id(str(path)) else Path(path)


def resolve_checkpoint(resume: str, output_dir: str | Path, what: str = "train.resume") -> Path:
    """'latest' (in output_dir), a run folder or a checkpoint folder -> the checkpoint folder.

    Raises:
        VlaforgeError: nothing to resume from there.
    """
    path = Path(output_dir) if resume == "latest" else Path(resume)
    if has_weights(path):
        return path
    latest = path / "checkpoints" / "latest"
    if what == "train.resume" and os.environ.get("WORLD_SIZE", "1") == "1" and latest.is_file():
        finish_interrupted_saves(latest.parent)  # NOTE: one process only: ranks resolve at once (their next save
        # finishes it then)
    if latest.is_file():
        name = _read_latest(latest)
        ckpt = path / "checkpoints" / name
        if has_weights(ckpt):
            return ckpt
    fix = ", or drop --train.resume" if what == "train.resume" else ""
    raise VlaforgeError(f"{what}: no checkpoint at {path} (expected {MODEL_FILE}, {DCP_DIR}/ or checkpoints/latest); "
                        f"give a run folder or a checkpoints/step_* folder{fix}")


def _read_latest(latest: Path) -> str:
    """The checkpoint name in a `latest` file: one folder name, nothing else."""
    try:
        name = latest.read_bytes().decode("utf-8").strip()
    except (UnicodeDecodeError, OSError):
        name = ""
    if not name or "/" in name or "\\" in name or name in (".", "..") or len(name) > 255:
        raise VlaforgeError(f"{latest} does not name a checkpoint folder; write the name of a step_* folder "
                            "into it, or give the checkpoints/step_* folder itself")
    return name


def run_folder_of(ckpt: Path) -> Path:
    """The run a checkpoint belongs to: RUN for RUN/checkpoints/step_*, else the checkpoint's own parent."""
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def resolve_run(path: str | Path, what: str = "CHECKPOINT"):
    """A run folder, a checkpoints/step_* folder or `latest` -> (checkpoint folder, its saved config): the pair
    every verb that reads a trained run starts from; `what` names the option in errors.

    Raises:
        VlaforgeError: nothing to load there, or its config.toml is missing or invalid.
    """
    ckpt = resolve_checkpoint(str(path), ".", what=what)
    return ckpt, saved_config(ckpt, what)


def saved_config(folder: Path, what: str = "CHECKPOINT", lerobot: dict | None = None):
    """The resolved config a checkpoint (or an exported package) carries in its config.toml; for a LeRobot policy
    folder (SmolVLA, pi0: one more checkpoint kind), the config that uses it as it is (`lerobot`: its other
    `model.lerobot` settings, e.g. declared sizes).

    Raises:
        VlaforgeError: the file is missing or not a valid vlaforge config.
    """
    from vlaforge.config.loading import load_config
    from vlaforge.models.policies.reader import is_lerobot_folder

    if is_lerobot_folder(folder):
        return lerobot_config(folder, lerobot)

    if not (Path(folder) / CONFIG_FILE).is_file() and (Path(folder) / "config.json").is_file():
        from vlaforge.models.policies.reader import read_policy_config

        read_policy_config(folder)  # meant as a LeRobot folder: says what its config.json lacks
    if not (Path(folder) / CONFIG_FILE).is_file():
        raise VlaforgeError(f"{what} {folder} has no {CONFIG_FILE}; the checkpoint is incomplete: use another "
                            "checkpoint of the run")
    return load_config(Path(folder) / CONFIG_FILE, saved=True)


def lerobot_config(folder: str | Path, lerobot: dict | None = None):
    """The vlaforge config of a LeRobot policy folder used as it is (`model.lerobot.pretrained` = the folder, plus
    `lerobot`'s other `model.lerobot` settings: vlm, tokenizer, sizes)."""
    from vlaforge.config.schema import VLAConfig
    from vlaforge.models.policies.reader import read_policy_config, shapes_of

    cameras, state_dim, action_dim = shapes_of(read_policy_config(folder))
    return VLAConfig.model_validate({"model": {"lerobot": {**(lerobot or {}), "pretrained": str(folder)},
                                               "cameras": list(cameras), "state_dim": state_dim,
                                               "action_dim": action_dim}})


def refuse_lerobot_policy(path: str | Path, verb: str, runs: bool = True, instead: str = "") -> None:
    """`verb` (a package export, quantization) is not built for LeRobot policies (`--format lerobot` is; `--format
    onnx` is for runs fine-tuned from one: `runs` False): one line before anything runs, ending in `instead` (what
    else the user can do) where given.

    Raises:
        VlaforgeError: `path` is a LeRobot policy folder, or (`runs`) a run fine-tuned from one.
    """
    from vlaforge.models.policies.reader import is_lerobot_folder

    if is_lerobot_folder(path):
        if not runs:
            raise VlaforgeError(f"{verb} of a LeRobot policy folder is not built (its observations go through "
                                "LeRobot's processor pipelines, not a package's contract); export a run fine-tuned "
                                "from it (vlaforge train with model.lerobot.pretrained), or serve the folder as it is")
        hit = True
    elif not runs:
        return
    else:
        try:
            hit = bool(saved_config(resolve_checkpoint(str(path), ".", what="CHECKPOINT")).model.lerobot.pretrained)
        except VlaforgeError:
            return  # the verb itself says what is wrong with the path
    if hit:
        raise VlaforgeError(f"{verb} of a LeRobot policy (SmolVLA, pi0, pi0.5) is not built yet; `vlaforge serve` "
                            "and `vlaforge eval` run it as it is, `vlaforge export --format lerobot` writes it as a "
                            f"LeRobot folder{instead}")
