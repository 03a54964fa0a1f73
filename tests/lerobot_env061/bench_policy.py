"""LeRobot 0.6.1's side of bench/lerobot_policies.py: builds a policy folder at given sizes with LeRobot's own
`save_pretrained`, and measures one setting of LeRobot's training step or prediction in this process (a fresh one
per call: its memory figures are its own).

usage: PYTHONPATH=.venv/lerobot061:tests/lerobot_env061 python tests/lerobot_env061/bench_policy.py MODE ARGS
  build KIND SPEC OUT               OUT/policy (+ OUT/vlm for SmolVLA, OUT/tokenizer + OUT/sizes.json for pi0 /
                                    pi0.5) at SPEC's sizes (JSON, below); OUT/info.json written last
  train POLICY_DIR INPUTS SETTING STEPS    STEPS training steps of LeRobot's policy in SETTING
  predict POLICY_DIR INPUTS SETTINGS RUNS  the prediction latency of each SETTING (comma-separated), RUNS timed calls
  tensors POLICY_DIR INPUTS SETTING        live tensor bytes of one forward + backward per INPUTS file (comma-
                                           separated): kept for backward and the peak (bench/lora.py's counting)
SETTING: float32 | bfloat16 (pi0 / pi0.5: the config's `dtype`; SmolVLA, which has no such option: the VLM cast to
bfloat16 and the expert left in float32, as `load_vlm_weights=True` loads it) | bfloat16-all (SmolVLA: the whole
policy cast), with `+gc` for the config's `gradient_checkpointing` (pi0 / pi0.5; SmolVLA has none in 0.6.1).
SPEC: {"kind", "cameras": [keys], "image_shape": [3, H, W], "state_dim", "action_dim", "config": {PI0Config /
SmolVLAConfig fields}, "vlm": SmolVLM config dict (SmolVLA), "sizes": tiny_pi0 sizes without the vocabulary (pi0)}.
INPUTS (safetensors): the cameras (B, 3, H, W) in [0, 1], observation.state (B, S), action (B, T, A), noise
(B, T, max_action_dim), time (B,); metadata {"tasks": json list}.

A training step is LeRobot's `update_policy` without the accelerator: policy.forward on the preprocessed batch (the
noise and flow times pinned to INPUTS'), backward, the global gradient norm clipped at the config's
optimizer_grad_clip_norm, the config's optimizer preset (torch AdamW over `get_optim_params()`) stepped, gradients
set to None. A prediction is `predict_action_chunk` on the preprocessed batch without actions (what `select_action`
runs when its queue is empty), `num_steps` / `num_inference_steps` = 10, under torch.no_grad.
Each mode prints one JSON line; memory is the process's resident set (/proc/self/status: VmRSS, and VmHWM, the
high-water mark, reset once policy, optimizer and batch are ready); CPU only.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # bench/lora.py's counting (train, tensors)

# ---- memory ----------------------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def settle() -> float:
    """Frees what the allocator holds loose and resets the resident high-water mark; the RSS now (MiB)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS
    return _status_kib("VmRSS") / 1024


def peaks() -> dict:
    """The process's resident-set peaks (MiB): since the last `settle`, and over its life (ru_maxrss)."""
    import resource

    return {"peak_rss_mib": _status_kib("VmHWM") / 1024,
            "lifetime_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


# ---- build -----------------------------------------------------------------------------------------------------
def _features(spec: dict):
    from lerobot.configs import FeatureType, PolicyFeature

    inputs = {cam: PolicyFeature(type=FeatureType.VISUAL, shape=tuple(spec["image_shape"])) for cam in spec["cameras"]}
    inputs["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(spec["state_dim"],))
    return dict(input_features=inputs,
                output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(spec["action_dim"],))})


def _smolvlm(vlm: dict, out: Path) -> Path:
    """SmolVLA's VLM folder at `vlm`'s sizes: its config, a tiny BPE tokenizer (the config keeps its vocabulary) and
    the processor; no weights (SmolVLA builds with `load_vlm_weights=False`, random)."""
    from make_policy import smolvlm_tokenizer
    from transformers import SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    tokenizer = smolvlm_tokenizer()
    text = {**vlm["text_config"], "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id}
    config = SmolVLMConfig(vision_config=vlm["vision_config"], text_config=text, scale_factor=vlm["scale_factor"],
                           image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                           pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=vlm["tie_word_embeddings"])
    config.save_pretrained(out)
    side, patch = vlm["vision_config"]["image_size"], vlm["vision_config"]["patch_size"]
    size = {"longest_edge": side}
    SmolVLMProcessor(image_processor=SmolVLMImageProcessor(size=size, max_image_size=size, do_image_splitting=False),
                     tokenizer=tokenizer, video_processor=SmolVLMVideoProcessor(size=size, max_image_size=size),
                     image_seq_len=(side // patch) ** 2 // vlm["scale_factor"] ** 2).save_pretrained(out)
    return out


def _local_tokenizer_processors(processor, make, config, stats, tokenizer_dir: Path):
    """pi0's / pi0.5's pipelines with the tokenizer step on a local tokenizer (the saved step names it)."""
    real_step = processor.TokenizerProcessorStep

    def local_step(**kwargs):
        kwargs.pop("tokenizer_name")
        return real_step(tokenizer_name=str(tokenizer_dir), **kwargs)

    processor.TokenizerProcessorStep = local_step
    try:
        return make(config, dataset_stats=stats)
    finally:
        processor.TokenizerProcessorStep = real_step


def build(kind: str, spec: dict, out: Path) -> dict:
    """OUT/policy written by LeRobot's save_pretrained at SPEC's sizes (every parameter perturbed, seeded)."""
    import lerobot
    from make_policy import dataset_stats, perturb, pi_classes, pi_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    stats = dataset_stats()
    common = {**spec["config"], **_features(spec), "device": "cpu", "push_to_hub": False}
    torch.manual_seed(0)
    if kind == "smolvla":
        from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
        from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
        from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

        vlm = _smolvlm(spec["vlm"], out / "vlm").resolve()
        config = SmolVLAConfig(**common, vlm_model_name=str(vlm), load_vlm_weights=False)
        policy = SmolVLAPolicy(config)
        pre, post = make_smolvla_pre_post_processors(config, dataset_stats=stats)
    else:
        tokenizer_dir = pi_tokenizer(kind, out, lambda vocab: {**spec["sizes"], "vocab_size": vocab})
        processor, Config, Policy, make = pi_classes(kind)
        config = Config(**common)
        policy = Policy(config)
        pre, post = _local_tokenizer_processors(processor, make, config, stats, tokenizer_dir)
    perturb(policy, check=False)
    policy.save_pretrained(out / "policy")
    pre.save_pretrained(out / "policy")
    post.save_pretrained(out / "policy")
    info = {"kind": kind, "lerobot": lerobot.__version__, "torch": torch.__version__,
            "parameters": sum(p.numel() for p in policy.parameters()),
            "trainable_parameters": sum(p.numel() for p in policy.parameters() if p.requires_grad)}
    (out / "info.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


# ---- measure ---------------------------------------------------------------------------------------------------
def load(policy_dir: Path, setting: str):
    """(LeRobot's policy in SETTING, its preprocessor, the RSS in MiB before the policy was built - its modules
    imported).

    Raises:
        ValueError: a setting this policy type has no option for."""
    from lerobot.configs import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors

    dtype, _, extra = setting.partition("+")
    config = PreTrainedConfig.from_pretrained(policy_dir)
    smolvla = config.type == "smolvla"
    if extra not in ("", "gc") or dtype not in ("float32", "bfloat16") + (("bfloat16-all",) if smolvla else ()):
        raise ValueError(f"unknown setting {setting!r} for {config.type}")
    if not smolvla:
        import tiny_pi0

        tiny_pi0.apply(json.loads((policy_dir.parent / "sizes.json").read_text()))
        config.dtype, config.gradient_checkpointing = dtype, extra == "gc"
    elif extra == "gc":
        raise ValueError("LeRobot 0.6.1's SmolVLA has no gradient checkpointing option")
    policy_class = get_policy_class(config.type)
    start = settle()
    policy = policy_class.from_pretrained(policy_dir, config=config)
    if smolvla and dtype == "bfloat16":  # the VLM in bf16, the expert in fp32: as load_vlm_weights=True loads it
        policy.model.vlm_with_expert.vlm.to(torch.bfloat16)
    elif smolvla and dtype == "bfloat16-all":  # the whole policy cast
        policy.to(torch.bfloat16)
    pre, _ = make_pre_post_processors(config, pretrained_path=str(policy_dir))
    return policy, pre, start


def step_of(loss_of, trained: list, clip: float, optimizer):
    """One training step as a call returning its loss: `loss_of()`, backward, the gradient norm clipped, the
    optimizer stepped and the gradients set to None. Both sides' step (bench/lerobot_policies_worker.py too)."""
    def step() -> float:
        loss = loss_of()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def train_steps(step, steps: int) -> dict:
    """`steps` calls of `step` (`step_of`), timed: {"step_s": seconds per step, "loss": step 1's, "losses", the
    resident-set `peaks` (read now)}; then, untimed, two more under the profiler for the second's peak live tensor
    bytes (bench/lora.py's `step_tensor_peak`)."""
    from lora import step_tensor_peak

    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    rss = peaks()
    return {"step_s": times, "loss": losses[0], "losses": losses, **rss, **step_tensor_peak(step, warm=1)}


def read_inputs(path: Path) -> tuple[dict, list[str]]:
    inputs = load_file(path)
    with safe_open(path, "pt") as f:
        tasks = json.loads(f.metadata()["tasks"])
    return inputs, tasks


def _pin(policy, noise: torch.Tensor, time_: torch.Tensor | None) -> dict:
    """Fixes the flow-matching noise and times; the keyword arguments policy.forward / predict take for them."""
    if policy.name == "smolvla":
        return {"noise": noise.clone()} if time_ is None else {"noise": noise.clone(), "time": time_.clone()}
    policy.model.sample_noise = lambda shape, device: noise.clone().to(device)
    if time_ is not None:
        policy.model.sample_time = lambda bsize, device: time_.clone().to(device)
    return {}


def _pinned_loss(policy, pre, inputs_path: Path):
    """(the training loss of the inputs file's batch through LeRobot's preprocessor at its pinned noise and flow
    times, as a call; that batch's size)."""
    inputs, tasks = read_inputs(inputs_path)
    noise, time_ = inputs.pop("noise"), inputs.pop("time")
    batch = pre({**inputs, "task": tasks})
    kwargs = _pin(policy, noise, time_)
    return (lambda: policy.forward(dict(batch), **kwargs)[0]), len(tasks)


def train(policy_dir: Path, inputs_path: Path, setting: str, steps: int) -> dict:
    policy, pre, start = load(policy_dir, setting)
    loss_of, _ = _pinned_loss(policy, pre, inputs_path)
    policy.train()
    optimizer = policy.config.get_optimizer_preset().build(policy.get_optim_params())
    trained = [p for p in policy.parameters() if p.requires_grad]
    loaded = settle()
    run = train_steps(step_of(loss_of, trained, policy.config.optimizer_grad_clip_norm, optimizer), steps)
    return {"setting": setting, "rss_start_mib": start, "rss_loaded_mib": loaded, **run,
            "trainable_parameters": sum(p.numel() for p in trained),
            "parameters": sum(p.numel() for p in policy.parameters())}


def predict(policy_dir: Path, inputs_path: Path, setting: str, runs: int) -> dict:
    policy, pre, _ = load(policy_dir, setting)
    if policy.name == "smolvla":
        policy.config.num_steps = 10
    else:
        policy.config.num_inference_steps = 10
    inputs, tasks = read_inputs(inputs_path)
    noise = inputs.pop("noise")
    inputs.pop("time", None)
    inputs.pop("action", None)
    batch = {k: v for k, v in pre({**inputs, "task": tasks}).items() if not k.endswith("_is_pad")}
    kwargs = _pin(policy, noise, None)
    policy.eval()
    times = []
    with torch.no_grad():
        actions = policy.predict_action_chunk(dict(batch), **kwargs)  # warm-up
        for _ in range(runs):
            policy.reset()
            t0 = time.perf_counter()
            policy.predict_action_chunk(dict(batch), **kwargs)
            times.append(time.perf_counter() - t0)
    return {"setting": setting, "median_ms": 1000 * statistics.median(times), "ms": [1000 * t for t in times],
            "actions": actions.float().flatten().tolist()}


def tensors(policy_dir: Path, inputs_paths: str, setting: str) -> dict:
    from lora import forward_backward_bytes

    policy, pre, _ = load(policy_dir, setting)
    policy.train()
    rows = {}
    for path in inputs_paths.split(","):
        loss_of, batch = _pinned_loss(policy, pre, Path(path))
        rows[str(batch)] = forward_backward_bytes(list(policy.parameters()), loss_of)
    return {"setting": setting, "batches": rows}


def _guarded(fn, setting: str, *args) -> dict:
    """fn's result, or the setting's failure in one line (LeRobot's own error)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a setting LeRobot cannot run is a result, reported as such
        line = (str(exc).strip().splitlines() or [""])[0][:300]
        return {"setting": setting, "failed": f"{type(exc).__name__}: {line}"}


def main(argv: list[str]) -> None:
    mode = argv[0] if argv else ""
    if len(argv) != {"build": 4, "train": 5, "predict": 5, "tensors": 4}.get(mode):
        sys.exit(__doc__)
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    if mode == "build":
        result = build(argv[1], json.loads(Path(argv[2]).read_text()), Path(argv[3]))
    elif mode == "tensors":
        result = _guarded(tensors, argv[3], Path(argv[1]).resolve(), argv[2], argv[3])
    elif mode == "train":
        result = _guarded(train, argv[3], Path(argv[1]).resolve(), Path(argv[2]), argv[3], int(argv[4]))
    else:
        result = {"predict": [_guarded(predict, s, Path(argv[1]).resolve(), Path(argv[2]), s, int(argv[4]))
                              for s in argv[3].split(",")]}
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
