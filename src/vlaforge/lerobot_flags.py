"""The flags of LeRobot 0.6.1's `lerobot-train` as `vlaforge lerobot-train` reads them: the command line split into
LeRobot's flags and vlaforge's own, each value read as LeRobot's parser (draccus) reads its field's type, and a row per
flag that is neither the policy's nor the run's own (src/vlaforge/lerobot_train.py): inert here (with a note), or
refused in one line naming the nearest vlaforge setting."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from vlaforge.errors import VlaforgeError

# ---- parsing the command line ---------------------------------------------------------------------------------

def split_argv(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(LeRobot's flags: name -> raw value, in order; vlaforge's own flags: --section.key=value). LeRobot's parser
    takes --flag=value and --flag value.

    Raises:
        VlaforgeError: a positional argument, a flag without a value, a flag given twice.
    """
    flags: dict[str, str] = {}
    ours: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise VlaforgeError(f"{arg!r}: lerobot-train takes --flag=value arguments only; write it as "
                                "--flag=value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise VlaforgeError(f"--{name} has no value; give it as --{name}=VALUE")
            value, i = argv[i + 1], i + 1
        if _is_vlaforge(name):
            ours.append(f"--{name}={value}")
        elif name in flags:
            raise VlaforgeError(f"--{name} is given twice; keep one")
        else:
            flags[name] = value
        i += 1
    return flags, ours


def _is_vlaforge(name: str) -> bool:
    """vlaforge's own sections (no LeRobot flag starts like them)."""
    return name.split(".")[0] in ("model", "components", "data", "train", "parallel", "loss", "loss_scale",
                                  "numerics", "diagnostics", "lerobot")


def value_of(name: str, raw: str, kind: str) -> Any:
    """`raw` as LeRobot's parser (draccus) reads a field of `kind`: bool, int, float, str, optional str, a list of
    ints, a JSON object / list, or `any` (JSON where it parses, else the string).

    Raises:
        VlaforgeError: a value of another type, naming the flag and what it takes.
    """
    text = raw.strip()
    try:
        if kind == "bool":
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return lowered in ("true", "1", "yes")
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind in ("str", "optional_str"):
            return None if kind == "optional_str" and text.lower() in ("null", "none", "") else text
        parsed = _loads(text)
        if kind == "int_list" and not (isinstance(parsed, list) and all(type(v) is int for v in parsed)):
            raise ValueError
        if kind == "object" and not isinstance(parsed, dict):
            raise ValueError
        return parsed
    except ValueError:
        what = {"bool": "true or false", "int": "an integer", "float": "a number", "int_list": "a list of integers "
                "such as [0,1,2]", "object": "a JSON object such as '{\"a\": 1}'"}.get(kind, "a value")
        raise VlaforgeError(f"--{name} takes {what}, not {raw!r}") from None


def _loads(text: str) -> Any:
    """JSON, with LeRobot's YAML-ish spellings (true / false / null, bare words) accepted."""
    try:
        return json.loads(text)
    except ValueError:
        low = text.lower()
        if low in ("true", "false"):
            return low == "true"
        if low in ("null", "none"):
            return None
        if text.startswith(("[", "{")):
            raise
        return text


# ---- every other flag: a row each ---------------------------------------------------------------------------

ANY = object()


@dataclass(frozen=True)
class Row:
    """A lerobot-train flag that changes nothing here for `accepted` values (ANY: every value, said in `note`), and
    is refused for others with `why` (which names the nearest vlaforge setting)."""

    kind: str = "any"
    accepted: Any = ANY
    why: str = ""
    note: str = ""
    apply_to: Callable[[Any, Any], None] | None = None  # (Translation, value)

    def apply(self, t, name: str, raw: str) -> None:
        value = value_of(name, raw, self.kind)
        if self.apply_to is not None:
            self.apply_to(t, value)
        elif self.accepted is not ANY and value not in self.accepted:
            raise VlaforgeError(f"--{name}={raw} {self.why}")
        elif self.note:
            t.notes.append(f"--{name}={raw}: {self.note}")


def _wandb(t, enabled: bool) -> None:
    if enabled:
        t.set("train.tensorboard", True)
        t.notes.append("--wandb.enable=true: vlaforge logs to TensorBoard (OUT/tensorboard) and OUT/metrics.jsonl; "
                       "`wandb sync OUT/tensorboard` uploads them")


_NO_ENV = ("is not built: simulator evaluation during training is vlaforge's `train --eval.every` (Meta-World "
           "datasets) or `vlaforge eval OUT --benchmark libero_object` after training; drop it")
ROWS: dict[str, Row] = {
    "dataset.image_transforms.enable": Row("bool", (False,), "is not built: LeRobot's image transforms are not "
                                           "vlaforge's augmentation (--data.augment_shift, --data.augment_color)"),
    "dataset.use_imagenet_stats": Row("bool", note="inert: these policies leave images unnormalized (VISUAL: "
                                      "IDENTITY), so ImageNet statistics are never read"),
    "dataset.video_backend": Row("str", note="vlaforge decodes videos with PyAV"),
    "dataset.streaming": Row("bool", (False,), "is not built: download the dataset (hf download ID --repo-type "
                             "dataset) and train from HF_LEROBOT_HOME"),
    "dataset.repo_type": Row("str", ("dataset",), "is not built: a Hub dataset repo only"),
    "dataset.eval_split": Row("float", (0.0,), "is not built: held-out loss evaluation; vlaforge eval measures "
                              "closed-loop success"),
    "dataset.return_uint8": Row("bool", note="inert: vlaforge decodes frames itself"),
    "dataset.depth_output_unit": Row("str", note="inert: depth cameras are not read"),
    "env_eval_freq": Row("int", note="inert without --env"),
    "eval_steps": Row("int", (0,), "is not built: held-out loss evaluation; drop it"),
    "max_eval_samples": Row("int", note="inert without --eval_steps"),
    "tolerance_s": Row("float", note="inert: vlaforge indexes frames, not timestamps"),
    "cudnn_deterministic": Row("bool", note="inert: vlaforge's runs are seeded; cuDNN's choice is torch's"),
    "prefetch_factor": Row("int", note="inert: vlaforge's loader keeps torch's default"),
    "persistent_workers": Row("bool", note="inert: vlaforge's loader workers persist"),
    "dataloader_multiprocessing_context": Row("optional_str", note="inert: vlaforge's loader uses torch's default"),
    "wandb.enable": Row("bool", apply_to=_wandb),
    "use_policy_training_preset": Row("bool", (True,), "is not built: give the optimizer and schedule through "
                                      "--policy.optimizer_* / --policy.scheduler_* (the preset's fields)"),
    "job.target": Row("optional_str", (None, "local"), "is not built: HF Jobs submission; run on this machine "
                      "(or under torchrun)"),
    "rename_map": Row("object", ({},), "is not built: rename the dataset's features to the policy's (or keep the "
                      "dataset's: vlaforge fits the policy to the dataset's cameras)"),
    "save_checkpoint_to_hub": Row("bool", (False,), "is not built: vlaforge does not upload; push "
                                  "OUT/checkpoints/last/pretrained_model with `hf upload REPO_ID DIR`"),
}
# whole flag families: refused, or inert (`None` why)
PREFIXES: dict[str, str | None] = {
    "env.": _NO_ENV, "eval.": None, "wandb.": None, "job.": None, "dataset.image_transforms.": None,
    "optimizer.": "is not built: LeRobot's optimizer section replaces the policy's preset; set "
                  "--policy.optimizer_lr / _betas / _eps / _weight_decay / _grad_clip_norm instead",
    "scheduler.": "is not built: set --policy.scheduler_warmup_steps / _decay_steps / _decay_lr instead",
    "sample_weighting.": "is not built: sample weighting (RA-BC); drop it",
    "reward_model.": "is not built: reward-model training; drop it",
}


def row_of(name: str) -> Row:
    """The row of a flag left after the policy's and the run's own.

    Raises:
        VlaforgeError: a refused flag family, or a flag no row knows.
    """
    if name in ROWS:
        return ROWS[name]
    prefix = next((p for p in PREFIXES if name.startswith(p)), None)
    if prefix is None:
        raise VlaforgeError(f"--{name} is not a lerobot-train flag vlaforge knows (LeRobot 0.6.1's flags: "
                            "docs/lerobot_policies.md lists the table); vlaforge's own settings go as "
                            "--section.key=value")
    if PREFIXES[prefix] is not None:
        raise VlaforgeError(f"--{name} {PREFIXES[prefix]}")
    return Row(note="inert here")
