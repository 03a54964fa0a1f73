"""A LeRobot policy folder written from vlaforge (`vlaforge export --format lerobot`, and a `lerobot-train` run's
`checkpoints/<step>/pretrained_model/`): a LeRobot policy (SmolVLA, pi0, pi0.5) written back as the folder LeRobot
0.6.1's own `from_pretrained` loads - from a folder LeRobot wrote, or from a run fine-tuned from one - with no missing
or unexpected keys, giving vlaforge's actions for the same inputs and noise (docs/lerobot_policies.md).

  OUT/config.json               the source folder's (a run keeps it in backbones.json); for a run, input / output
                                features set to its cameras (3, render, render) and state / action sizes
  OUT/model.safetensors         vlaforge's tensors under LeRobot's names (families.py's key map, inverted), a tied LM
                                head under both names, and what vlaforge drops zero-filled (pi0's expert LM head)
  OUT/policy_preprocessor.json  LeRobot's pipelines and their state files: a folder's copied; a run's are the folder's
  OUT/policy_postprocessor.json steps with its dataset statistics (the policy's own normalization_mapping, as
                                lerobot-train writes them; a run from before: MEAN_STD) and its tokenizer
  OUT/tokenizer/                (a run) the run's tokenizer (save_pretrained), which the tokenizer step names
  OUT/vlaforge_export.json      the report; `.vlaforge-owner.json` lets a later export replace OUT (vlaforge/outputs.py)

Written into a temporary folder beside OUT and renamed when complete; an OUT that is not such an export is refused.
"""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError
from vlaforge.outputs import check_replaceable, replace_folder, stamp

OWNER = "vlaforge export --format lerobot"  # the command in the folder's ownership stamp
REPORT, CONFIG, WEIGHTS, TOKENIZER = "vlaforge_export.json", "config.json", "model.safetensors", "tokenizer"
PRETRAINED, TRAIN_CONFIG, LAST = "pretrained_model", "train_config.json", "last"  # LeRobot's checkpoint layout
PIPELINES = {"policy_preprocessor.json": "policy_preprocessor", "policy_postprocessor.json": "policy_postprocessor"}
PREPROCESSOR = "policy_preprocessor.json"
NORMALIZERS = ("normalizer_processor", "unnormalizer_processor")
IMAGES = "observation.images."
# what a run trained with before policies normalized with their own mapping (a run's policy.json without norm_map):
# MEAN_STD for state and action, images as they are
RUN_NORMALIZATION = {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
# LeRobot's tensors that vlaforge drops (families.py's `dropped`), written back as zeros: LeRobot name -> shape
ZERO_FILLED = {"model.paligemma_with_expert.gemma_expert.lm_head.weight":
               lambda model: (model.llm.get_input_embeddings().weight.shape[0], model.action_head.width)}


def export_lerobot(path: str | Path, out: str | Path, lerobot: dict | None = None) -> dict[str, Any]:
    """Write the LeRobot folder `out` from a LeRobot policy folder or a run fine-tuned from one; the report (also
    OUT/vlaforge_export.json): source, tensors, what was zero-filled or tied, how the pipelines were made.

    Args:
        lerobot: a LeRobot folder's `model.lerobot` settings where it needs them (pi0's `sizes`, SmolVLA's `vlm`).

    Raises:
        VlaforgeError: one line: a run that is not a LeRobot policy, an `out` that is not an earlier export, a
            tensor with no LeRobot name, a run missing its statistics or tokenizer.
    """
    from vlaforge.models.policies.reader import is_lerobot_folder

    path, out = Path(path), Path(out)
    folder = is_lerobot_folder(path)
    ckpt = path if folder else _policy_run(path)
    _check_out(out, ckpt)
    model = _load_folder(path, lerobot) if folder else _load_run(ckpt)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        report = {"source": str(ckpt), "from": "LeRobot folder" if folder else "fine-tuned run",
                  "type": model.backbones["config"]["type"], "out": str(out)}
        report.update(_write_weights(model, tmp))
        report.update(_copy_folder(ckpt, tmp) if folder else _write_run(ckpt, model, tmp, out))
        (tmp / REPORT).write_text(json.dumps(report, indent=1) + "\n")  # NOTE: the folder is the atomic unit
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left; `out` is as it was
        raise
    stamp(tmp, OWNER)
    replace_folder(tmp, out)
    return report


def lerobot_step_name(step: int, total_steps: int) -> str:
    """LeRobot's `get_step_identifier`: the step zero-padded to max(6, digits of the run's total steps)."""
    return f"{step:0{max(6, len(str(total_steps)))}d}"


def write_lerobot_checkpoint(ckpt: Path, run_dir: Path, step: int, total_steps: int, record: dict) -> Path:
    """LeRobot's checkpoint layout of a vlaforge checkpoint (`[lerobot] layout`): RUN/checkpoints/<step>/
    pretrained_model/ (the policy folder `lerobot-eval --policy.path` and `from_pretrained` load, with the run's
    statistics and tokenizer, and train_config.json: `record`, the lerobot-train command it came from), written
    beside and renamed into place, and RUN/checkpoints/last pointing at it (a relative link, as LeRobot's). Returns
    the pretrained_model folder."""
    root = Path(run_dir) / "checkpoints"
    name = lerobot_step_name(step, total_steps)
    final, tmp = root / name, root / f".{name}.lerobot.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / PRETRAINED).mkdir(parents=True)
    try:
        model = _load_run(ckpt)
        _write_weights(model, tmp / PRETRAINED)
        _write_run(ckpt, model, tmp / PRETRAINED, final / PRETRAINED)
        (tmp / PRETRAINED / TRAIN_CONFIG).write_text(json.dumps(record, indent=4) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    link = root / f".last.{name}.tmp"
    link.unlink(missing_ok=True)
    link.symlink_to(name)
    link.replace(root / LAST)  # NOTE: atomic: `last` names a complete checkpoint at every instant
    return final / PRETRAINED


def _policy_run(path: Path) -> Path:
    """The checkpoint of a run fine-tuned from a LeRobot folder (refused in one line for any other run)."""
    from vlaforge.checkpoints.layout import resolve_run

    ckpt, cfg = resolve_run(path)
    if not cfg.model.lerobot.pretrained:
        raise VlaforgeError(f"exporting to LeRobot needs a run fine-tuned from a LeRobot folder "
                            f"(model.lerobot.pretrained) or such a folder; {path} is a vlaforge VLA run, which has no "
                            "LeRobot policy type: export it with --format onnx, executorch or safetensors")
    return ckpt


def _check_out(out: Path, ckpt: Path) -> None:
    """`out` may be written: not the policy it exports, and new or an earlier export, unchanged (with its tokenizer/).

    Raises:
        VlaforgeError: one line naming what is in the way.
    """
    if out.resolve() == ckpt.resolve() or ckpt.resolve().is_relative_to(out.resolve()):
        raise VlaforgeError(f"--out {out} would replace the policy it exports; choose a new folder")
    check_replaceable(out, OWNER, folders=(TOKENIZER,))


def _load_folder(folder: Path, lerobot: dict | None):
    from vlaforge.config.model import LeRobotSource
    from vlaforge.models.policies.reader import load_policy, overrides_from

    source = LeRobotSource(**{**(lerobot or {}), "pretrained": str(folder)})
    with warnings.catch_warnings():  # NOTE: the tensors the reader drops are written back; the report says how
        warnings.simplefilter("ignore")
        return load_policy(folder, overrides_from(source))


def _load_run(ckpt: Path):
    from vlaforge.checkpoints.load import load_policy_model

    model, _, _ = load_policy_model(ckpt)
    return model


def lerobot_state(model) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The policy's tensors under LeRobot's names (every one mapped back through families.py's key map) plus the
    zero-filled ones LeRobot holds and vlaforge drops; and what the report says of them.

    Raises:
        VlaforgeError: a tensor with no LeRobot name, or a dropped tensor with no fill.
    """
    from vlaforge.models.policies.families import family_of

    fam = family_of(model.backbones["config"].get("type"), "config.json")
    state, owner, unmapped, tied = {}, {}, [], []
    for comp in COMPONENTS:
        for inner, tensor in getattr(model, comp).state_dict().items():
            name = fam.lerobot_name(comp, inner)
            if name is None or fam.why_dropped(name):
                unmapped.append(f"{comp}.{inner}")
                continue
            ptr = tensor.data_ptr()
            if tensor.numel() and ptr in owner:  # a tied pair (pi0's LM head and embeddings): both names, two copies
                tied.append([owner[ptr], name])
                tensor = tensor.clone()
            owner.setdefault(ptr, name)
            state[name] = tensor.detach().contiguous()
    if unmapped:
        raise VlaforgeError(f"{len(unmapped)} tensors of the {fam.name} policy have no LeRobot name in "
                            f"models/policies/families.py's key map ({', '.join(unmapped[:3])}); exporting them to "
                            "LeRobot is not built")
    filled = []
    for prefix, why in fam.dropped:
        names = [n for n in ZERO_FILLED if n.startswith(prefix)]
        if not names:
            raise VlaforgeError(f"LeRobot's {prefix}* ({why}) is dropped by vlaforge and has no zero fill; exporting "
                                f"a {fam.name} policy to LeRobot is not built")
        for name in names:
            shape = tuple(ZERO_FILLED[name](model))
            state[name] = torch.zeros(shape, dtype=model.llm.get_input_embeddings().weight.dtype)
            filled.append({"name": name, "shape": list(shape), "why": why})
    return state, {"tensors": len(state), "zero_filled": filled, "tied": tied}


def _write_weights(model, tmp: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    state, report = lerobot_state(model)
    save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
    return report


def _pipeline_steps(folder: Path) -> dict[str, list[dict]]:
    """The step entries of a folder's two processor JSONs, refused in one line where one is missing or unreadable."""
    steps = {}
    for file in PIPELINES:
        try:
            steps[file] = json.loads((folder / file).read_text())["steps"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise VlaforgeError(f"{folder / file} cannot be read as a LeRobot pipeline ({str(exc)[:100]}); give the "
                                "folder LeRobot's save_pretrained wrote") from None
    return steps


def _copy_folder(folder: Path, tmp: Path) -> dict[str, Any]:
    """A LeRobot folder's own config.json, pipelines and their state files, copied as they are."""
    shutil.copy2(folder / CONFIG, tmp / CONFIG)
    for file, steps in _pipeline_steps(folder).items():
        shutil.copy2(folder / file, tmp / file)
        for entry in steps:
            if entry.get("state_file"):
                shutil.copy2(folder / entry["state_file"], tmp / entry["state_file"])
    return {"config": "the folder's", "pipelines": "the folder's, copied"}


def _write_run(ckpt: Path, model, tmp: Path, out: Path) -> dict[str, Any]:
    """A fine-tuned run's config.json (its features), pipelines (its statistics and tokenizer) and tokenizer."""
    from vlaforge.checkpoints.layout import saved_config
    from vlaforge.data.transforms import ObservationSpec

    spec = ObservationSpec.load(ckpt)
    cfg, notes = _run_config(model.backbones["config"], spec)
    (tmp / CONFIG).write_text(json.dumps(cfg, indent=4) + "\n")
    source = _source_folder(saved_config(ckpt).model.lerobot.pretrained)
    if all((source / f).is_file() for f in PIPELINES):
        steps, origin = _pipeline_steps(source), f"the steps of {source}"
    else:
        steps, origin = default_steps(cfg), f"LeRobot 0.6.1's default {cfg['type']} steps ({source} is gone)"
    stats, how = run_statistics(spec)
    tokenizer = _hub_tokenizer(steps, saved_config(ckpt).model.lerobot.tokenizer) or str(out.resolve() / TOKENIZER)
    notes += _write_pipelines(steps, cfg, stats, tokenizer, source, tmp)
    _save_tokenizer(ckpt / TOKENIZER, tmp / TOKENIZER)
    return {"config": "the source folder's, the run's features", "pipelines": f"{origin}, the run's statistics "
            f"({how}) and tokenizer ({tokenizer})", "notes": notes}


def _hub_tokenizer(steps: dict[str, list[dict]], override: str | None) -> str | None:
    """The Hub id the source pipeline's tokenizer step names (google/paligemma-3b-pt-224), kept as it is when the run
    used that tokenizer (no model.lerobot.tokenizer): LeRobot resolves it from the same cache; None otherwise (the
    run's tokenizer is written beside, and named by its path)."""
    from vlaforge import hub

    named = next((e.get("config", {}).get("tokenizer_name") for e in steps.get(PREPROCESSOR, [])
                  if e.get("registry_name") == "tokenizer_processor"), None)
    return named if override is None and isinstance(named, str) and hub.looks_like_id(named) else None


def _source_folder(ref: str) -> Path:
    """The folder a run was fine-tuned from (a Hub id: its cached snapshot; a path that is gone: as it is)."""
    from vlaforge import hub
    from vlaforge.models.policies.reader import policy_folder

    if not hub.looks_like_id(ref):
        return Path(ref)
    try:
        return policy_folder(ref, weights=False)
    except VlaforgeError:
        return Path(ref)


def run_statistics(spec) -> tuple[dict[str, torch.Tensor], str]:
    """The normalizer state a run trained with, as LeRobot's flat `<feature>.<stat>` tensors, and how it was made:
    a policy's own normalization with every statistic of the dataset (as lerobot-train writes them), else vlaforge's
    MEAN_STD with its floored std."""
    if spec.norm_map is not None:
        stats = {f"{key}.{stat}": torch.tensor(values, dtype=torch.float32)
                 for key, kinds in spec.stats.items() for stat, values in kinds.items()}
        return stats, f"{', '.join(f'{k} {m}' for k, m in spec.norm_map.items())}, the dataset's statistics"
    stats = {f"{key}.{stat}": torch.tensor(values, dtype=torch.float32)
             for key, name in (("observation.state", "state"), ("action", "action"))
             for stat, values in (("mean", getattr(spec, f"{name}_mean")), ("std", getattr(spec, f"{name}_std")))}
    return stats, "MEAN_STD, std floored as vlaforge trained"


def _run_config(source: dict, spec) -> tuple[dict, list[str]]:
    """config.json with the run's cameras and sizes and the normalization it trained with (the rest unchanged)."""
    cfg = copy.deepcopy(source)
    inputs = {(c if c.startswith(IMAGES) else IMAGES + c): {"type": "VISUAL", "shape": [3, spec.render_size,
                                                                                         spec.render_size]}
              for c in spec.cameras}
    inputs["observation.state"] = {"type": "STATE", "shape": [len(spec.state_mean)]}
    was = dict(cfg.get("normalization_mapping") or {})
    trained = dict(spec.norm_map) if spec.norm_map is not None else RUN_NORMALIZATION
    notes = [f"{kind}: the folder normalizes {was.get(kind, 'IDENTITY')}, the run trained with {mode}: written {mode} "
             "(normalization_mapping and norm_map)" for kind, mode in trained.items()
             if was.get(kind, "IDENTITY") != mode]
    cfg.update(input_features=inputs, output_features={"action": {"type": "ACTION", "shape": [len(spec.action_mean)]}},
               normalization_mapping={**was, **trained})
    return cfg, notes


def default_steps(cfg: dict) -> dict[str, list[dict]]:
    """LeRobot 0.6.1's pipelines for config.json's type as its `make_<type>_pre_post_processors` builds them
    (statistics and features are set by the caller), for a run whose source folder is gone.

    Raises:
        VlaforgeError: a type whose default pipelines are not written here (pi0.5 is not fine-tuned yet).
    """
    kind = cfg.get("type")
    if kind not in ("smolvla", "pi0"):
        raise VlaforgeError(f"the run's source folder is gone and LeRobot's default {kind} pipelines are not written "
                            "here; restore the folder at model.lerobot.pretrained")
    device = lambda name: {"registry_name": "device_processor", "config": {"device": name, "float_dtype": None}}
    norm = lambda reg: {"registry_name": reg, "config": {"eps": 1e-08, "features": {}, "norm_map": {}}}
    tokenizer = {"registry_name": "tokenizer_processor", "config": {
        "max_length": cfg.get("tokenizer_max_length", 48), "task_key": "task", "padding_side": "right",
        "padding": cfg.get("pad_language_to", "longest") if kind == "smolvla" else "max_length", "truncation": True,
        "tokenizer_name": cfg.get("vlm_model_name") if kind == "smolvla" else "google/paligemma-3b-pt-224"}}
    pre = [{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
           {"registry_name": "to_batch_processor", "config": {}},
           {"registry_name": f"{kind}_new_line_processor", "config": {}}, tokenizer, device(cfg.get("device") or "cpu")]
    post = [norm("unnormalizer_processor")]
    if kind == "pi0":
        relative = bool(cfg.get("use_relative_actions", False))
        pre.append({"registry_name": "relative_actions_processor", "config": {
            "enabled": relative, "exclude_joints": cfg.get("relative_exclude_joints", ["gripper"]),
            "action_names": cfg.get("action_feature_names")}})
        post.append({"registry_name": "absolute_actions_processor", "config": {"enabled": relative}})
    pre.append(norm("normalizer_processor"))
    post.append(device("cpu"))
    return dict(zip(PIPELINES, (pre, post), strict=True))


def _write_pipelines(steps: dict[str, list[dict]], cfg: dict, stats: dict[str, torch.Tensor], tokenizer: str,
                     source: Path, tmp: Path) -> list[str]:
    """The two processor JSONs in LeRobot's format, the normalizers' state files named as LeRobot names them
    (`<pipeline>_step_<i>_<registry name>.safetensors`) and holding `stats`; what changed, as notes."""
    from safetensors.torch import save_file

    notes = []
    features = {**cfg["input_features"], **cfg["output_features"]}
    for file, pipeline in PIPELINES.items():
        written = []
        for i, entry in enumerate(copy.deepcopy(steps[file])):
            reg, conf = entry.get("registry_name"), entry.setdefault("config", {})
            if reg in NORMALIZERS:
                conf["features"] = features if reg == "normalizer_processor" else dict(cfg["output_features"])
                conf["norm_map"] = dict(cfg["normalization_mapping"])
                entry["state_file"] = f"{pipeline}_step_{i}_{reg}.safetensors"
                save_file(stats, str(tmp / entry["state_file"]))
            elif reg == "tokenizer_processor":
                conf["tokenizer_name"] = tokenizer
            elif reg in ("relative_actions_processor", "absolute_actions_processor") and conf.get("enabled"):
                conf["enabled"] = False  # vlaforge's data pipeline trained the run on absolute actions
                notes.append(f"{file}: {reg} disabled (the run trained on absolute actions)")
            elif entry.get("state_file"):
                shutil.copy2(source / entry["state_file"], tmp / entry["state_file"])
            written.append(entry)
        (tmp / file).write_text(json.dumps({"name": pipeline, "steps": written}, indent=2))
    return notes


def _save_tokenizer(folder: Path, dest: Path) -> None:
    from transformers import AutoTokenizer

    if not folder.is_dir():
        raise VlaforgeError(f"{folder} is missing: the checkpoint keeps the policy's tokenizer there; export another "
                            "checkpoint of the run")
    AutoTokenizer.from_pretrained(str(folder), local_files_only=True).save_pretrained(str(dest))


def render(report: dict[str, Any]) -> str:
    """The report as a few lines for the terminal."""
    lines = [f"wrote {report['out']}: a LeRobot {report['type']} folder from the {report['from']} {report['source']} "
             f"({report['tensors']} tensors; config.json {report['config']}; pipelines {report['pipelines']})"]
    lines += [f"zero-filled: {f['name']} {tuple(f['shape'])} ({f['why']})" for f in report["zero_filled"]]
    lines += [f"tied: {a} written also as {b}" for a, b in report["tied"]]
    lines += [f"note: {n}" for n in report.get("notes", [])]
    return "\n".join(lines)
