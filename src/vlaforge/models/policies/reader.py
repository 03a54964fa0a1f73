"""Reading a folder LeRobot 0.6.x wrote (`save_pretrained` / `lerobot-train`): config.json (with `type`),
model.safetensors, and the processor pipelines beside them. The key map is strict both ways: every tensor of the
file lands in a parameter of the same shape (or is one the family drops, said in a notice), and every parameter is
given, or the load is refused in one line naming the first offending keys. LeRobot's own loaders return random
weights (pi0) or only warn (SmolVLA) on such a mismatch; vlaforge does not.

Also read: the `joint_layers` layout of LeRobot's open PR 3767 is not (0.6.1, the newest release, writes the layout
above); a file in it is refused by the strict map, naming its keys.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import torch

from vlaforge.errors import VlaforgeError
from vlaforge.models.policies.checks import json_file, pickles_in, refuse_pickles
from vlaforge.models.policies.families import FIELD, Overrides, PolicyFamily, build_policy, family_of
from vlaforge.models.policies.model import PolicyVLA
from vlaforge.models.vlm import _expected

WEIGHTS = "model.safetensors"
PROCESSOR_FILES = ("policy_preprocessor.json", "policy_postprocessor.json")


def is_lerobot_folder(path: str | Path) -> bool:
    """Whether `path` is meant as a LeRobot policy folder: config.json with a `type`, and weights (model.safetensors,
    or only pickles, which `read_policy_config` refuses saying how to convert). A config.json that does not parse,
    beside weights and no vlaforge config.toml, counts too: `read_policy_config` then names its line and column
    (rather than a vlaforge checkpoint's missing config.toml)."""
    folder = Path(path)
    config = folder / "config.json"
    if not (config.is_file() and ((folder / WEIGHTS).is_file() or pickles_in(folder))):
        return False
    try:
        found = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return not (folder / "config.toml").is_file()
    return isinstance(found, dict) and "type" in found


def policy_folder(ref: str | Path, weights: bool = True, field: str = FIELD) -> Path:
    """The local folder of a LeRobot policy given as a folder or a Hub id (`lerobot/smolvla_base[@rev]`, resolved
    through the Hugging Face cache: `vlaforge.hub`); `weights`: its model.safetensors is needed (else its JSON files
    are enough: planning, config checks)."""
    from vlaforge import hub

    return hub.local_folder(ref, field, hub.POLICY if weights else hub.POLICY_CONFIG)


def read_policy_config(folder: str | Path, overrides: dict | None = None) -> dict:
    """config.json of a LeRobot policy folder, checked to name a type vlaforge reads, with `overrides`
    (`model.lerobot.config`: lerobot-train's --policy.FIELD=VALUE) replacing its fields.

    Raises:
        VlaforgeError: not a folder, no config.json or weights (pickles only: how to convert), invalid JSON (its line
            and column), another policy type, an override of a field the type does not have, a value out of its
            range (`checks.py`), after the overrides.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise VlaforgeError(f"{FIELD}: {folder} is not a folder; give the folder LeRobot's save_pretrained wrote")
    refuse_pickles(folder, FIELD, WEIGHTS)
    for name in ("config.json", WEIGHTS):
        if not (folder / name).is_file():
            raise VlaforgeError(f"{FIELD}: {folder} has no {name}; give the folder LeRobot's save_pretrained wrote "
                                f"(config.json, {WEIGHTS}, {', '.join(PROCESSOR_FILES)})")
    cfg = json_file(folder / "config.json", FIELD)
    if not isinstance(cfg, dict) or "type" not in cfg:
        raise VlaforgeError(f"{FIELD}: {folder / 'config.json'} has no 'type'; it is not a LeRobot policy folder")
    fam = family_of(cfg["type"], str(folder))
    cfg = with_overrides(cfg, overrides or {}, str(folder))
    fam.check(cfg, f"{FIELD}: {folder}", frozenset(overrides or {}))
    return cfg


def with_overrides(cfg: dict, overrides: dict, where: str) -> dict:
    """config.json's fields replaced by `overrides` (model.lerobot.config); `type` cannot change.

    Raises:
        VlaforgeError: a field that neither the folder's config.json nor LeRobot 0.6.1's defaults of its type have.
    """
    from vlaforge.models.policies.defaults import DEFAULT_POLICIES

    defaults = DEFAULT_POLICIES.get(cfg["type"])
    known = set(cfg) | set(defaults.config if defaults is not None else {})
    for key in overrides:
        if key == "type" or key not in known:
            why = "cannot change the policy type" if key == "type" else f"is not a field of a {cfg['type']} config"
            raise VlaforgeError(f"model.lerobot.config.{key} {why} ({where}/config.json); fields: "
                                f"{', '.join(sorted(k for k in known if k != 'type'))[:300]}")
    merged = {**cfg, **overrides}
    if defaults is not None and not merged.get("normalization_mapping"):  # LeRobot's default for the type
        merged["normalization_mapping"] = dict(defaults.config["normalization_mapping"])
    return merged


def _state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(folder / WEIGHTS))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise VlaforgeError(f"{FIELD}: {folder / WEIGHTS} cannot be read ({str(exc).splitlines()[0]}); it is "
                            "truncated or not a safetensors file: copy the folder again") from None


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def map_state(fam: PolicyFamily, model: PolicyVLA, state: dict[str, torch.Tensor],
              where: str) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """LeRobot's tensors -> per component {name: tensor}; also the names dropped (with the family's reason).

    Raises:
        VlaforgeError: a tensor no component takes, a shape that differs, a parameter the file does not give.
    """
    parts = {c: {} for c in ("vision", "projector", "llm", "action_head")}
    dropped, unknown = [], []
    own = {c: getattr(model, c).state_dict() for c in parts}
    for name, value in state.items():
        if fam.why_dropped(name):
            dropped.append(name)
            continue
        target = fam.key(name)
        if target is None or target[1] not in own[target[0]]:
            unknown.append(name)
            continue
        comp, inner = target
        if tuple(value.shape) != tuple(own[comp][inner].shape):
            raise VlaforgeError(f"{FIELD}: {where}: {name} is {tuple(value.shape)} in the file and "
                                f"{tuple(own[comp][inner].shape)} in the {fam.name} policy its config.json "
                                "describes; the weights and the config disagree")
        parts[comp][inner] = value
    if unknown:
        raise VlaforgeError(f"{FIELD}: {where}: {len(unknown)} tensors of the file are not parameters of the "
                            f"{fam.name} policy its config.json describes ({_shown(sorted(unknown))}); vlaforge "
                            "loads nothing silently: give the folder LeRobot's save_pretrained wrote")
    for comp in parts:  # a tied pair given twice: the name the model computes with wins (LeRobot 0.6.1 unties
        for group in _expected(getattr(model, comp)):  # pi0's embed_tokens and unused lm_head under transformers 5)
            given = [n for n in group if n in parts[comp]]
            for extra in sorted(given, key=lambda n: "lm_head" not in n)[:-1] if len(given) > 1 else []:
                parts[comp].pop(extra)
                dropped.append(f"{comp}.{extra}")
    missing = [f"{c}.{g[0]}" for c in parts for g in _expected(getattr(model, c))
               if not any(n in parts[c] for n in g)]
    if missing:
        raise VlaforgeError(f"{FIELD}: {where}: {len(missing)} parameters are not in the file "
                            f"({_shown(sorted(missing))}); they would train from random values: give the whole "
                            "folder LeRobot's save_pretrained wrote")
    return parts, dropped


def load_policy(folder: str | Path, over: Overrides | None = None, fake: bool = False,
                config: dict | None = None) -> PolicyVLA:
    """The policy in a LeRobot folder as a vlaforge model, its weights loaded strictly (fp32)."""
    folder = Path(folder)
    cfg = read_policy_config(folder, config)
    over = over or Overrides()
    model = build_policy(cfg, over, fake=fake)
    if fake:
        return model
    fam = family_of(cfg["type"], str(folder))
    parts, dropped = map_state(fam, model, _state(folder), str(folder))
    for comp, tensors in parts.items():
        getattr(model, comp).load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    if dropped:
        why = fam.why_dropped(dropped[0]) or "an LM head tied to the embeddings, given apart (the model never uses it)"
        warnings.warn(f"{folder}: {len(dropped)} tensors dropped ({', '.join(dropped[:2])}): {why}", stacklevel=2)
    return model.float()


def overrides_from(source) -> Overrides:
    """`model.lerobot`'s declarations as the builder's `Overrides` (the sizes file read and checked here).

    Raises:
        VlaforgeError: the sizes file is missing or not a JSON object.
    """
    sizes = None
    if source.sizes:
        path = Path(source.sizes)
        try:
            sizes = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise VlaforgeError(f"model.lerobot.sizes: {path} cannot be read as JSON ({exc}); give the sizes file "
                                "docs/lerobot_policies.md describes") from None
        if not isinstance(sizes, dict):
            raise VlaforgeError(f"model.lerobot.sizes: {path} holds a JSON {type(sizes).__name__}, not an object")
    return Overrides(vlm=source.vlm, sizes=sizes)


def shapes_of(cfg: dict) -> tuple[list[str], int, int]:
    """(camera names without 'observation.images.', state size, action size) of a policy's config.json."""
    from vlaforge.models.policies.families import _features

    cameras, state_dim, action_dim = _features(cfg)
    return [c.removeprefix("observation.images.") for c in cameras], state_dim, action_dim


def fit_shapes(model: PolicyVLA, model_cfg) -> None:
    """The run's cameras and state / action sizes (a fine-tune's dataset) in place of the folder's: the weights do
    not depend on them (images are tokens, vectors are zero-padded to max_state_dim / max_action_dim).

    Raises:
        VlaforgeError: a size over the policy's max_state_dim / max_action_dim.
    """
    import dataclasses

    spec = model.spec
    for name, size, most in (("state_dim", model_cfg.state_dim, spec.max_state_dim),
                             ("action_dim", model_cfg.action_dim, spec.max_action_dim)):
        if size > most:
            raise VlaforgeError(f"model.{name} = {size} is over the policy's max_{name} = {most}; a LeRobot policy "
                                "zero-pads vectors up to that size and cannot take more")
    cameras = tuple(c if c.startswith("observation.images.") else f"observation.images.{c}" for c in model_cfg.cameras)
    model.spec = dataclasses.replace(spec, cameras=cameras, state_dim=model_cfg.state_dim,
                                     action_dim=model_cfg.action_dim)
    model.action_head.action_dim = model_cfg.action_dim


def build_lerobot(model_cfg, fake: bool = False, saved: dict | None = None) -> PolicyVLA:
    """The policy `model.lerobot` names, with its pipelines as `.pipelines` (pre, post) while its folder is there,
    shaped to the run's cameras and sizes where they are known. `saved`: what a checkpoint kept of the folder
    (`PolicyVLA.backbones`: config.json, the VLM's config, declared sizes): the policy is built from it, weights
    random (the checkpoint's follow), and needs no folder."""
    from vlaforge.models.fake import fake_build, fake_mode_active
    from vlaforge.models.policies.processors import load_pipelines

    source = model_cfg.lerobot
    folder = Path(source.pretrained)
    if saved is None:  # (a checkpoint's own copy needs no folder)
        folder = policy_folder(source.pretrained, weights=not fake)
    if saved is not None:
        over = Overrides(sizes=saved.get("sizes"), vlm_config=saved.get("vlm"))
        with fake_build() if fake and not fake_mode_active() else contextlib.nullcontext():
            model = build_policy(saved["config"], over, fake=fake)
    elif fake:
        with fake_build() if not fake_mode_active() else contextlib.nullcontext():
            model = build_policy(read_policy_config(folder, source.config), overrides_from(source), fake=True)
    else:
        model = load_policy(folder, overrides_from(source), config=source.config)
    # the folder's own pipelines: required when the policy comes from the folder, read when a checkpoint's folder is
    # still there (a fine-tuned run predicts through its own policy.json and tokenizer)
    wanted = not fake and (saved is None or (folder / PROCESSOR_FILES[0]).is_file())
    model.pipelines = load_pipelines(folder, tokenizer_override=source.tokenizer) if wanted else None
    if model_cfg.shapes_known():
        fit_shapes(model, model_cfg)
    return model
