"""`vlaforge lerobot-train`: LeRobot 0.6.1's `lerobot-train` command line, unchanged, as a vlaforge run.

Every flag either becomes a vlaforge setting, with LeRobot's semantics where they differ from vlaforge's defaults
(its defaults for flags left out, `batch_size` as samples per step, its optimizer and scheduler presets from the
policy's config, weight decay on every parameter, the scheduler's shrinking for short runs, a fixed seed of 1000), or
is refused in one line naming why and the nearest vlaforge setting. A flag no table row knows is refused the same
way. The policy's own `--policy.FIELD` values replace its config.json's (`model.lerobot.config`), as LeRobot's do.
vlaforge's own flags may follow (`--components.llm.checkpointing=full`): they apply last.

The run writes vlaforge's checkpoints and LeRobot's layout beside them (`[lerobot] layout`), and keeps both command
lines in its config (`lerobot.command`, `lerobot.translated`) and in each pretrained_model/train_config.json.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlaforge.errors import VlaforgeError
from vlaforge.lerobot_flags import row_of, split_argv, value_of

RECIPES = Path(__file__).resolve().parents[2] / "recipes"  # the repository's recipes (an editable install's)
TYPES = ("smolvla", "pi0", "pi05")
# TrainPipelineConfig's defaults (LeRobot 0.6.1, configs/train.py) for flags a command line leaves out
DEFAULTS = {"batch_size": 8, "steps": 100_000, "seed": 1000, "num_workers": 4, "log_freq": 200, "save_freq": 20_000}
COMPONENTS = ("vision", "projector", "llm", "action_head")
# the policy config fields that are the run's training settings (the rest reach the model through model.lerobot.config)
TRAINING_FIELDS = {"optimizer_lr", "optimizer_betas", "optimizer_eps", "optimizer_weight_decay",
                   "optimizer_grad_clip_norm", "scheduler_warmup_steps", "scheduler_decay_steps", "scheduler_decay_lr",
                   "train_expert_only", "freeze_vision_encoder", "gradient_checkpointing", "compile_model",
                   "compile_mode", "device", "dtype", "use_amp", "push_to_hub", "repo_id", "private", "tags", "license",
                   "use_peft", "pretrained_path"}


@dataclass
class Translation:
    """What a lerobot-train command line became."""

    argv: list[str]
    recipe: str = ""
    overrides: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    resume: Path | None = None  # the run folder `--resume=true --config_path=...` continues

    def command(self) -> str:
        """The `vlaforge train` command line it became."""
        head = ["vlaforge", "train", self.recipe] if self.resume is None else \
            ["vlaforge", "train", "--resume", str(self.resume)]
        return " ".join(shlex.quote(a) for a in [*head, *self.overrides])

    def set(self, key: str, value: Any) -> None:
        """A vlaforge override --key=value (TOML value; strings quoted)."""
        self.overrides.append(f"--{key}={_toml(value)}")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


# ---- the policy ---------------------------------------------------------------------------------------------

@dataclass
class Policy:
    """The policy a command line names: its folder (or Hub id), type, effective config (LeRobot's: the folder's
    config.json for --policy.path, the type's defaults for --policy.type, then the --policy.* flags) and the fields
    that replace the folder's config.json for the run (`model.lerobot.config`)."""

    source: str
    type: str
    config: dict
    overrides: dict[str, Any]


def read_policy(flags: dict[str, str]) -> Policy:
    """--policy.path, or --policy.type with --policy.pretrained_path, and the --policy.* fields (taken from `flags`).

    Raises:
        VlaforgeError: neither or both sources, a type vlaforge does not fine-tune, a type other than the folder's,
            a field the type does not have or a value of the wrong type.
    """
    from vlaforge.models.policies.defaults import DEFAULT_POLICIES
    from vlaforge.models.policies.reader import policy_folder, read_policy_config

    path, kind, pretrained = (flags.pop(f"policy.{k}", None) for k in ("path", "type", "pretrained_path"))
    if path and (kind or pretrained):
        other = "--policy.type" if kind else "--policy.pretrained_path"
        raise VlaforgeError(f"--policy.path loads a policy's config and weights; {other} conflicts with it: keep "
                            "--policy.path, or give --policy.type with --policy.pretrained_path")
    if not path and not pretrained:
        raise VlaforgeError("no policy to fine-tune: give --policy.path=FOLDER_OR_HUB_ID (e.g. lerobot/smolvla_base), "
                            "or --policy.type with --policy.pretrained_path (training a policy from scratch is not "
                            "built: vlaforge fine-tunes pretrained ones)")
    source = path or pretrained
    revision = flags.pop("policy.pretrained_revision", None)  # LeRobot's revision of a Hub id: id@revision here
    if revision and revision.lower() not in ("null", "none") and "@" not in source:
        source = f"{source}@{revision}"
    where = "--policy.path" if path else "--policy.pretrained_path"
    folder_cfg = read_policy_config(policy_folder(source, weights=False, field=where))
    if kind is not None and kind != folder_cfg["type"]:
        raise VlaforgeError(f"--policy.type={kind} but {source} holds a {folder_cfg['type']} policy; give "
                            f"--policy.type={folder_cfg['type']}")
    if folder_cfg["type"] not in TYPES:
        raise VlaforgeError(f"{source} is a {folder_cfg['type']} policy; lerobot-train through vlaforge fine-tunes "
                            f"{', '.join(TYPES)}")
    # LeRobot: --policy.type builds the config from the type's defaults, only the weights come from the folder
    base = dict(DEFAULT_POLICIES[folder_cfg["type"]].config) if kind else dict(folder_cfg)
    overrides = {k: v for k, v in base.items() if kind and k not in ("type", "input_features", "output_features")
                 and folder_cfg.get(k) != v}
    for name in [n for n in flags if n.startswith("policy.")]:
        key = name[len("policy."):]
        if key not in base and key not in folder_cfg:
            raise VlaforgeError(f"--{name}: {key} is not a field of a {folder_cfg['type']} policy config (see its "
                                "config.json for the fields)")
        overrides[key] = _field_value(name, flags.pop(name), base.get(key, folder_cfg.get(key)))
    overrides["pretrained_path"] = source
    return Policy(source, folder_cfg["type"], {**base, **overrides}, overrides)


def _field_value(name: str, raw: str, default: Any) -> Any:
    """A --policy.FIELD value read as the field's type (the type of its value in the config)."""
    kind = {bool: "bool", int: "int", float: "float", str: "optional_str", dict: "object"}.get(type(default), "any")
    if kind == "int":  # (a field LeRobot types float may hold an int in config.json: grad clip 10)
        value = value_of(name, raw, "float")
        return int(value) if value.is_integer() and "." not in raw else value
    return value_of(name, raw, kind)


# ---- the translation ----------------------------------------------------------------------------------------

def translate(argv: list[str]) -> Translation:
    """The vlaforge run a lerobot-train command line is.

    Raises:
        VlaforgeError: one line for a flag refused, unknown, of the wrong type or in conflict.
    """
    flags, ours = split_argv(argv)
    t = Translation(argv=list(argv))
    resume = value_of("resume", flags.pop("resume"), "bool") if "resume" in flags else False
    config_path = flags.pop("config_path", None)
    if resume:
        return _resume(t, config_path, flags, ours)
    if config_path is not None:
        raise VlaforgeError("--config_path without --resume=true (a train_config.json as the whole command) is not "
                            "read; give the flags on the command line")
    policy = read_policy(flags)
    recipe = RECIPES / f"{policy.type}.toml"
    t.recipe = str(recipe if recipe.is_file() else Path("recipes") / f"{policy.type}.toml")
    t.set("model.lerobot.pretrained", policy.source)
    t.set("model.lerobot.config", policy.overrides)
    _policy_settings(t, policy)
    _run_settings(t, flags, policy)
    for name in list(flags):
        row_of(name).apply(t, name, flags.pop(name))
    t.set("lerobot.layout", True)
    t.set("lerobot.command", t.argv)
    t.overrides += ours
    t.set("lerobot.translated", t.command())
    return t


def _policy_settings(t: Translation, policy: Policy) -> None:
    """The policy config's training settings (its presets, replaced by the command line's values) as vlaforge's."""
    cfg = policy.config
    lr = float(cfg["optimizer_lr"])
    for c in COMPONENTS:
        t.set(f"components.{c}.lr", lr)
        t.set(f"components.{c}.weight_decay", float(cfg["optimizer_weight_decay"]))
    frozen = {"vision", "projector", "llm"} if cfg.get("train_expert_only") else \
        ({"vision"} if cfg.get("freeze_vision_encoder") else set())
    for c in ("vision", "projector", "llm"):
        t.set(f"components.{c}.trainable", c not in frozen)
    t.set("train.betas", [float(b) for b in cfg["optimizer_betas"]])
    t.set("train.eps", float(cfg["optimizer_eps"]))
    t.set("train.grad_clip", float(cfg["optimizer_grad_clip_norm"]))
    t.set("train.decay_all", True)  # LeRobot's AdamW decays every parameter (no norm / bias group)
    t.set("train.lr_schedule", "cosine_decay_with_warmup")
    t.set("train.warmup_steps", int(cfg["scheduler_warmup_steps"]))
    t.set("train.decay_steps", int(cfg["scheduler_decay_steps"]))
    t.set("train.min_lr_ratio", float(cfg["scheduler_decay_lr"]) / lr)
    _precision(t, cfg)
    if cfg.get("gradient_checkpointing"):
        t.set("components.llm.checkpointing", "full")  # the joint layers (VLM block + expert block)
        t.set("components.vision.checkpointing", "full")
    if cfg.get("compile_model"):
        t.set("train.compile", True)
        t.notes.append("--policy.compile_model=true -> train.compile (torch.compile per joint layer and tower block, "
                       f"torch's default mode; LeRobot's compile_mode {cfg.get('compile_mode')!r} is not applied)")
    if cfg.get("use_relative_actions"):
        raise VlaforgeError("--policy.use_relative_actions=true is not built: vlaforge fine-tunes on absolute "
                            "actions; drop it")
    _device(t, str(cfg.get("device") or "auto"))
    if cfg.get("repo_id"):
        t.set("lerobot.repo_id", str(cfg["repo_id"]))


def _precision(t: Translation, cfg: dict) -> None:
    """--policy.dtype (pi0, pi0.5), else --policy.use_amp (SmolVLA, which has no dtype: LeRobot autocasts) as the
    components' compute precision; vlaforge keeps fp32 master weights (LeRobot's bfloat16 pi0 keeps most in bf16).

    Raises:
        VlaforgeError: a dtype other than bfloat16, float16, float32.
    """
    import torch

    if "dtype" in cfg:
        mode = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(str(cfg["dtype"]))
        if mode is None:
            raise VlaforgeError(f"--policy.dtype={cfg['dtype']} is not one of bfloat16, float16, float32")
    elif cfg.get("use_amp"):
        mode = "fp16" if torch.cuda.is_available() else "bf16"  # autocast's default dtype per device
    else:
        mode = "fp32"
    for c in COMPONENTS:
        t.set(f"components.{c}.precision", mode)
    if mode != "fp32":
        t.notes.append(f"the policy computes in {mode} (components.*.precision) over fp32 master weights")


def _device(t: Translation, device: str) -> None:
    import torch

    if device.startswith(("mps", "xpu")):
        raise VlaforgeError(f"--policy.device={device} is not built; use cuda or cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        t.notes.append(f"--policy.device={device}: no CUDA device here, training on the CPU (LeRobot falls back "
                       "alike)")
        device = "cpu"
    t.set("train.device", "cuda" if device.startswith("cuda") else ("cpu" if device == "cpu" else "auto"))


def _run_settings(t: Translation, flags: dict[str, str], policy: Policy) -> None:
    """TrainPipelineConfig's own flags (LeRobot's defaults where left out) and --peft.* as vlaforge's settings."""
    def get(name: str, kind: str) -> Any:
        return value_of(name, flags.pop(name), kind) if name in flags else DEFAULTS.get(name)

    repo_id = get("dataset.repo_id", "str")
    if not repo_id:
        raise VlaforgeError("--dataset.repo_id is required (a Hub dataset id such as lerobot/libero, found in "
                            "HF_LEROBOT_HOME or --dataset.root)")
    t.set("data.source", "lerobot")
    t.set("data.path", repo_id)
    for key, kind in (("root", "optional_str"), ("revision", "optional_str"), ("episodes", "int_list")):
        value = get(f"dataset.{key}", kind)
        if value is not None:
            t.set(f"data.{key}", value)
    steps, seed = get("steps", "int"), flags.get("seed", "1000")
    if seed.strip().lower() in ("null", "none"):
        raise VlaforgeError("--seed=null (no seeding) is not built: vlaforge seeds every run so it resumes "
                            "bit-exactly; give --seed=N")
    t.set("train.steps", steps)
    t.set("train.batch_size", get("batch_size", "int"))
    t.set("train.grad_accum", 1)  # LeRobot's batch_size is the samples of one optimizer step (per process)
    t.set("train.seed", get("seed", "int"))
    t.set("data.num_workers", get("num_workers", "int"))
    log = get("log_freq", "int")
    t.set("train.log_every", log if log > 0 else steps)
    save = get("save_freq", "int")
    t.set("train.checkpoint_every", save if save > 0 else 0)
    if "save_checkpoint" in flags and not get("save_checkpoint", "bool"):
        raise VlaforgeError("--save_checkpoint=false is not built: vlaforge always writes the final checkpoint (a run "
                            "without one cannot be resumed, evaluated or served); drop it (--save_freq=0 keeps only "
                            "the final one)")
    job = get("job_name", "optional_str") or policy.type  # LeRobot's default without an env
    t.set("lerobot.job_name", job)
    out = get("output_dir", "optional_str") or \
        str(Path("outputs/train") / f"{dt.datetime.now():%Y-%m-%d}" / f"{dt.datetime.now():%H-%M-%S}_{job}")
    t.set("train.output_dir", out)
    _peft(t, {k: flags.pop(k) for k in [n for n in flags if n.startswith("peft.")]})


def _peft(t: Translation, given: dict[str, str]) -> None:
    """--peft.*: LoRA on LeRobot's default targets of the policy (the expert's q/v projections and the state, action
    and time projections) with the VLM frozen, rank --peft.r (16), alpha --peft.lora_alpha (peft's default 8)."""
    if not given:
        return
    method = value_of("peft.method_type", given.pop("peft.method_type", "LORA"), "str")
    if method.upper() != "LORA":
        raise VlaforgeError(f"--peft.method_type={method}: only LORA is built (vlaforge's components.<c>.lora)")
    for name in ("target_modules", "full_training_modules", "init_type"):
        if value_of(f"peft.{name}", given.pop(f"peft.{name}", "null"), "any") is not None:
            raise VlaforgeError(f"--peft.{name} is not taken: vlaforge adapts LeRobot's default targets of the "
                                "policy; set components.<c>.lora.targets / .full instead (docs/lora.md)")
    rank = value_of("peft.r", given.pop("peft.r", "16"), "int")
    alpha = value_of("peft.lora_alpha", given.pop("peft.lora_alpha", "null"), "any")
    if given:
        raise VlaforgeError(f"--{next(iter(given))} is not a --peft flag LeRobot 0.6.1 has (method_type, r, "
                            "lora_alpha, target_modules, full_training_modules, init_type)")
    t.set("components.action_head.lora", {"targets": "lerobot", "rank": rank, "alpha": float(alpha or 8)})
    for c in ("vision", "projector", "llm"):
        t.set(f"components.{c}.trainable", False)
    t.notes.append(f"--peft.*: LoRA rank {rank}, alpha {alpha or 8} on LeRobot's default targets; checkpoints hold the "
                   "adapters, pretrained_model/ the merged policy")


# ---- resuming ---------------------------------------------------------------------------------------------------

RESUMABLE = {"steps": "train.steps", "save_freq": "train.checkpoint_every", "log_freq": "train.log_every",
             "num_workers": "data.num_workers"}


def _resume(t: Translation, config_path: str | None, flags: dict[str, str], ours: list[str]) -> Translation:
    """--resume=true with --config_path (LeRobot's: OUT/checkpoints/last/pretrained_model[/train_config.json]) or
    --output_dir: the run folder continues from its latest checkpoint with its own config; --steps and the logging /
    saving cadence may change, as LeRobot lets them.

    Raises:
        VlaforgeError: no run found there, or a flag that would change the run.
    """
    where = config_path or flags.pop("output_dir", None)
    if where is None:
        raise VlaforgeError("--resume=true needs --config_path=OUT/checkpoints/last/pretrained_model/"
                            "train_config.json (or --output_dir=OUT) naming the run to continue")
    path = Path(where)
    run = next((p for p in (path, *path.parents) if (p / "config.toml").is_file() and (p / "checkpoints").is_dir()),
               None)
    if run is None:
        raise VlaforgeError(f"--resume=true: no vlaforge lerobot-train run at or above {where} (a folder with "
                            "config.toml and checkpoints/); give the run's --output_dir")
    flags.pop("output_dir", None)
    t.resume = run
    for name in list(flags):
        if name not in RESUMABLE:
            raise VlaforgeError(f"--{name} with --resume=true: a resumed run keeps its own settings (those of "
                                f"{run}/config.toml); only {', '.join('--' + n for n in RESUMABLE)} may change")
        value = value_of(name, flags.pop(name), "int")
        t.set(RESUMABLE[name], value if value > 0 or name == "save_freq" else 1)
    t.overrides += ours
    return t
