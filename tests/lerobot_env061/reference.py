"""LeRobot 0.6.1's own numbers for a policy folder of make_policy.py: loads it with LeRobot's `from_pretrained`
(pi0, pi05: with tiny_pi0.py's patch at the folder's sizes.json) and its processors with
`PolicyProcessorPipeline.from_pretrained` (through LeRobot's `make_pre_post_processors(pretrained_path=...)`), and
runs the batch in INPUTS through them: fp32, CPU, `torch.manual_seed(0)`.

usage: PYTHONPATH=.venv/lerobot061:tests/lerobot_env061 python tests/lerobot_env061/reference.py POLICY_DIR INPUTS OUT

INPUTS (safetensors): observation.images.top / .wrist (B,3,24,32) in [0,1], observation.state (B,6), action (B,T,6)
raw, noise (B,T,A), time (B,), optional action_is_pad (B,T) bool; metadata {"tasks": json list of B strings}. T, A:
the folder's chunk_size and max_action_dim (5 and 8; 50 and 32 for the *_base kinds). A *_base folder's pipeline names
google/paligemma-3b-pt-224: run with HF_HUB_CACHE where that id is cached (tests/lerobot061.py does).
OUT (safetensors):
  pre.<key>   every tensor the preprocessor returns for the training batch
  losses      policy.model.forward(...) per element (B,T,A), inputs prepared as the policy's forward prepares them
              (pi05: no state argument, the state is in the prompt; empty cameras appended by LeRobot itself)
  loss        policy.forward(pre batch) with that noise and time (train mode); also in the metadata
  grad.<name> every parameter's gradient after loss.backward(), named as in the policy's state_dict
  sample      policy.model.sample_actions(..., noise=noise) in eval mode, untruncated (B,T,A)
  actions     policy.predict_action_chunk(pre batch without action) with the same noise (B,T,6)
  post        the postprocessor applied to actions (B,T,6)
  metadata    {"loss": float, "pre_steps": json list of registry names, "post_steps": ...}
Prints one JSON line: the weight check (keys compared, keys LeRobot's loader left missing because they are tied).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def load_policy(policy_dir: Path):
    """The policy by LeRobot's own `from_pretrained`; asserts every tensor of model.safetensors reached the model
    (LeRobot's generic loader is strict=False and pi0's swallows load errors): a key the file lacks is allowed only
    where the model ties it to a loaded one."""
    from lerobot.configs import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class

    config = PreTrainedConfig.from_pretrained(policy_dir)
    if config.type in ("pi0", "pi05"):
        import tiny_pi0

        tiny_pi0.apply(json.loads((policy_dir.parent / "sizes.json").read_text()))
    policy = get_policy_class(config.type).from_pretrained(policy_dir)
    policy.to(torch.float32)
    saved = load_file(policy_dir / "model.safetensors")
    state = policy.state_dict()
    unexpected = sorted(set(saved) - set(state))
    loaded_ptrs = {state[k].data_ptr() for k in state if k in saved}
    missing = sorted(k for k in state if k not in saved)
    untied = [k for k in missing if state[k].data_ptr() not in loaded_ptrs]
    differ = sorted(k for k in state if k in saved and not torch.equal(state[k], saved[k].to(state[k].dtype)))
    assert not (unexpected or untied or differ), \
        f"LeRobot's loader did not load {policy_dir}: unexpected {unexpected}, missing {untied}, differ {differ}"
    return policy, {"compared": len(state) - len(missing), "tied_missing": missing}


def step_names(pipeline) -> list[str]:
    return [getattr(type(step), "_registry_name", type(step).__name__) for step in pipeline.steps]


def prepare(policy, batch):
    """Images, masks, language, state as the policy's own forward / predict_action_chunk prepare them (pi05: no
    state; its preprocessor wrote the discretized state into the prompt)."""
    from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

    images, img_masks = (policy._preprocess_images(batch) if hasattr(policy, "_preprocess_images")
                         else policy.prepare_images(batch))
    prepared = (images, img_masks, batch[OBS_LANGUAGE_TOKENS], batch[OBS_LANGUAGE_ATTENTION_MASK])
    return prepared if policy.name == "pi05" else (*prepared, policy.prepare_state(batch))


def run(policy_dir: Path, inputs_path: Path, out_path: Path) -> dict:
    from lerobot.configs import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors

    torch.manual_seed(0)
    policy, check = load_policy(policy_dir)
    pre, post = make_pre_post_processors(PreTrainedConfig.from_pretrained(policy_dir),
                                         pretrained_path=str(policy_dir))
    inputs = load_file(inputs_path)
    with safe_open(inputs_path, "pt") as f:
        tasks = json.loads(f.metadata()["tasks"])
    noise, time = inputs.pop("noise"), inputs.pop("time")
    batch = pre({**inputs, "task": tasks})
    out = {f"pre.{k}": v.detach().clone().contiguous() for k, v in batch.items() if isinstance(v, torch.Tensor)}

    policy.train()
    with torch.no_grad():
        out["losses"] = policy.model.forward(*prepare(policy, batch), policy.prepare_action(batch), noise.clone(),
                                             time.clone())
    # pi0's and pi05's forward / predict_action_chunk take no noise: pin their samplers on the instance
    policy.model.sample_noise = lambda shape, device: noise.clone().to(device)
    policy.model.sample_time = lambda bsize, device: time.clone().to(device)
    kwargs = {"noise": noise.clone(), "time": time.clone()} if policy.name == "smolvla" else {}
    loss, _ = policy.forward(dict(batch), **kwargs)
    loss.backward()
    out["loss"] = loss.detach().reshape(())
    for name, p in policy.named_parameters():
        if p.grad is not None:
            out[f"grad.{name}"] = p.grad.detach().clone()

    policy.eval()
    policy.reset()
    with torch.no_grad():
        out["sample"] = policy.model.sample_actions(*prepare(policy, batch), noise=noise.clone())
        infer = {k: v for k, v in batch.items() if k != "action" and not k.endswith("_is_pad")}
        kwargs = {"noise": noise.clone()} if policy.name == "smolvla" else {}
        out["actions"] = policy.predict_action_chunk(infer, **kwargs)
        out["post"] = post(out["actions"].clone())
    meta = {"loss": repr(loss.item()), "pre_steps": json.dumps(step_names(pre)),
            "post_steps": json.dumps(step_names(post))}
    save_file({k: v.detach().contiguous() for k, v in out.items()}, out_path, metadata=meta)
    return check


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    print(json.dumps(run(Path(sys.argv[1]).resolve(), Path(sys.argv[2]), Path(sys.argv[3]))))
