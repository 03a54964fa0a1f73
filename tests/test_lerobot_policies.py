"""LeRobot's pretrained policies (SmolVLA, pi0) in vlaforge against LeRobot 0.6.1 itself, on folders LeRobot's own
`save_pretrained` wrote (tests/lerobot061.py builds them and runs the reference once per session): the processed
batch, per-element and scalar losses at fixed noise and time, every parameter's gradient, sampled actions at fixed
noise, and raw observation -> action through `PolicyRuntime`. fp32 on CPU; tolerances from the issue (1e-5)."""

from __future__ import annotations

import json
from pathlib import Path

import lerobot061 as ref061
import numpy as np
import pytest
import torch

from vlaforge.errors import VlaforgeError
from vlaforge.models.policies.model import PolicyVLA

pytestmark = pytest.mark.xdist_group("lerobot061")

KINDS = ("smolvla", "pi0", "pi05")
# and pi0.5 at LeRobot's default config (chunk 50, pads of 32, 224 px, a 200-token prompt; tests/lerobot061.py SHAPES)
PARITY_KINDS = (*KINDS, "pi05_base")
TOL = 1e-5


def _lerobot_options(out: Path) -> dict:
    """The folder's declared sizes (pi0*), and its tokenizer where its pipeline names PaliGemma's Hub id (*_base)."""
    options = ref061.folder_options(out)
    return {k: v for k, v in options.items() if k == "sizes" or ref061.hub_cache(out) is not None}


@pytest.fixture(scope="module")
def session_root(tmp_path_factory) -> Path:
    return ref061.session_root(tmp_path_factory)


def _folder(kind: str, root: Path) -> tuple[Path, dict]:
    out = ref061.policy_folder(kind, root)
    return out / "policy", _lerobot_options(out)


def _model(folder: Path, options: dict) -> PolicyVLA:
    from vlaforge.checkpoints.load import load_policy_model

    model, _, _ = load_policy_model(folder, lerobot=options)
    return model


@pytest.mark.parametrize("kind", PARITY_KINDS)
def test_losses_gradients_and_samples_match_lerobot(kind, session_root):
    folder, options = _folder(kind, session_root)
    inputs, tasks = ref061.sample_inputs(kind=kind)
    theirs, meta = ref061.reference(kind, session_root, inputs, tasks)
    model = _model(folder, options)
    pre, _ = model.pipelines
    raw = {k: v for k, v in inputs.items() if k not in ("noise", "time", "action_is_pad")}
    ours_pre = pre({**raw, "task": list(tasks)})
    for key, value in theirs.items():  # the pipeline: every tensor LeRobot's preprocessor returns
        if key.startswith("pre."):
            mine = ours_pre[key[4:]]
            assert mine.shape == value.shape, key
            assert torch.allclose(mine.to(value.dtype), value, atol=1e-6), key
    batch = {k[4:]: v for k, v in theirs.items() if k.startswith("pre.")}
    model.train()
    x = model.prepare(batch)
    losses = model.losses(x, inputs["noise"], inputs["time"])
    assert (losses - theirs["losses"]).abs().max() <= TOL
    loss = model.loss(x, inputs["noise"], inputs["time"])
    assert abs(loss.item() - meta["loss"]) <= TOL
    loss.backward()
    count, worst = ref061.worst_grad(model, theirs)  # relative per tensor, with a floor (its docstring)
    assert count > 20 and worst <= TOL, (count, worst)
    model.eval()
    sample = model.sample_actions(model.prepare(batch, with_actions=False), inputs["noise"])
    assert (sample - theirs["sample"]).abs().max() <= TOL
    _, post = model.pipelines
    assert (post(sample[:, :, :model.spec.action_dim]) - theirs["post"]).abs().max() <= 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_a_frozen_vlm_side_runs_the_prefix_context_without_autograd(kind, session_root):
    """With the tower, projector and LLM frozen (SmolVLA's default, `train_expert_only`), the prefix's context runs
    once without autograd and only SmolVLA's state token crosses the VLM's blocks with it (pi0 / pi0.5: nothing): the
    loss and the action expert's gradients are still LeRobot's."""
    from vlaforge.models.policies.families import family_of

    folder, options = _folder(kind, session_root)
    inputs, tasks = ref061.sample_inputs(kind=kind)
    theirs, meta = ref061.reference(kind, session_root, inputs, tasks)
    model = _model(folder, options)
    for module in (model.vision, model.projector, model.llm):
        module.requires_grad_(False)
    calls = []  # (tokens, autograd on) of each call of the VLM's first MLP
    model.llm.get_decoder().layers[0].mlp.register_forward_hook(
        lambda _m, args, _out: calls.append((args[0].shape[1], torch.is_grad_enabled())))
    model.train()
    loss = model.loss(model.prepare({k[4:]: v for k, v in theirs.items() if k.startswith("pre.")}),
                      inputs["noise"], inputs["time"])
    assert abs(loss.item() - meta["loss"]) <= TOL
    loss.backward()
    fam = family_of(model.spec.family, "test")
    head = {k: v for k, v in theirs.items() if not k.startswith("grad.") or fam.key(k[5:])[0] == "action_head"}
    count, worst = ref061.worst_grad(model, head)
    assert count > 10 and worst <= TOL, (count, worst)
    assert all(p.grad is None for p in model.llm.parameters())
    (context, autograd), *rest = calls
    assert not autograd and [g for _, g in rest] == ([True] if kind == "smolvla" else []), calls
    assert all(tokens < context for tokens, _ in rest), calls


@pytest.mark.parametrize("kind", KINDS)
def test_the_prefix_runs_without_its_padding(kind, session_root, monkeypatch):
    """Tokens that are padding in every sample (the tokenizer's max-length padding, SmolVLA's zeros up to
    `prefix_length`) never reach the VLM's blocks, in training or prediction (`drop_padding`), and the loss, its
    gradients and the actions are those of the whole prefix (the parity test above holds with them dropped too)."""
    import vlaforge.models.policies.model as policy_model

    model = _model(*_folder(kind, session_root))
    inputs, tasks = ref061.sample_inputs(kind=kind)
    theirs, _ = ref061.reference(kind, session_root, inputs, tasks)
    batch = {k[4:]: v for k, v in theirs.items() if k.startswith("pre.")}
    _, pad, _ = model.embed_prefix(model.prepare(batch))
    i = int(pad.sum(1).argmin())  # the sample with the shortest prompt, alone
    one = lambda v: v[i:i + 1] if isinstance(v, torch.Tensor) and len(v) == len(pad) else v
    batch, noise, time = {k: one(v) for k, v in batch.items()}, one(inputs["noise"]), one(inputs["time"])
    x = model.prepare(batch)
    _, pad, _ = model.embed_prefix(x)
    real = int(pad.sum())
    assert real < pad.shape[1], (real, pad.shape)
    seen = []  # tokens of each call of the VLM's first MLP
    model.llm.get_decoder().layers[0].mlp.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[1]))

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model.train()
        model.zero_grad()
        loss = model.loss(x, noise, time)
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        model.eval()
        return loss.detach(), grad, model.sample_actions(model.prepare(batch, with_actions=False), noise)

    dropped = run()
    assert seen == [real, real], (seen, real)
    with torch.no_grad():  # the exported prefix graph's: the whole length, whatever a prompt's padding
        _, kept = model.prefix_pass(model.prepare(batch, with_actions=False), whole=True)
    assert kept.shape == pad.shape and seen[2:] == [pad.shape[1]], (kept.shape, seen)
    del seen[2:]
    monkeypatch.setattr(policy_model, "drop_padding", lambda *prefix: prefix)
    whole = run()
    assert seen[2:] == [pad.shape[1]] * 2, seen
    assert abs(dropped[0] - whole[0]) <= 1e-6 * abs(whole[0])
    assert (dropped[1] - whole[1]).abs().max() <= TOL * whole[1].abs().max()
    assert (dropped[2] - whole[2]).abs().max() <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_runtime_predict_matches_lerobot_from_raw_observations(kind, session_root):
    from vlaforge.inference.runtime import Observation, PolicyRuntime

    folder, options = _folder(kind, session_root)
    g = torch.Generator().manual_seed(3)
    frames = {cam: torch.randint(0, 256, (1, 24, 32, 3), generator=g, dtype=torch.uint8) for cam in ("top", "wrist")}
    state = torch.randn(1, 6, generator=g)
    noise = torch.randn(1, 5, 8, generator=g)
    inputs = {f"observation.images.{c}": f.permute(0, 3, 1, 2).float() / 255 for c, f in frames.items()}
    inputs.update({"observation.state": state, "action": torch.zeros(1, 5, 6), "noise": noise,
                   "time": torch.full((1,), 0.5)})
    theirs, _ = ref061.reference(kind, session_root, inputs, ["pick up the cube"])
    runtime = PolicyRuntime.load(folder, device="cpu", lerobot=options)
    obs = Observation({c: f[0].numpy() for c, f in frames.items()}, state[0].numpy(), "pick up the cube")
    pred = runtime.predict(obs, noise=noise[0].numpy())
    assert pred.actions.shape == (5, 6)
    assert np.abs(pred.actions - theirs["post"][0].numpy()).max() <= 1e-4
    assert runtime.describe()["action_chunk"] == 5
    small = Observation({c: f[0, ::2, ::2].numpy() for c, f in frames.items()}, state[0].numpy(), "pick up the cube")
    both = runtime.predict_batch([obs, small], ["big", "small"])  # two robots, two camera sizes: batched apart
    assert [p.actions.shape for p in both] == [(5, 6), (5, 6)] and all(np.isfinite(p.actions).all() for p in both)
    with pytest.raises(VlaforgeError, match="missing"):
        runtime.predict(Observation({"top": frames["top"][0].numpy()}, state[0].numpy(), "x"))


def test_folder_refusals(session_root, tmp_path):
    """Another policy type, a missing / extra / misshapen tensor: one line each, naming the problem."""
    import shutil

    from safetensors.torch import load_file, save_file

    from vlaforge.models.policies.reader import load_policy, overrides_from

    folder, options = _folder("pi0", session_root)
    over = overrides_from(type("S", (), {"sizes": options.get("sizes"), "vlm": None})())

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(folder, dst)
        return dst

    other = copy("act")
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "type": "act"}))
    with pytest.raises(VlaforgeError, match="'act' policy; vlaforge reads these types: smolvla, pi0"):
        load_policy(other, over)
    state = load_file(str(folder / "model.safetensors"))
    name = next(k for k in state if "action_in_proj.weight" in k)
    for case, change in (("missing", lambda s: s.pop(name)),
                         ("extra", lambda s: s.update({"model.surprise.weight": torch.zeros(2)})),
                         ("shape", lambda s: s.update({name: torch.zeros(3, 3)}))):
        bad = copy(case)
        s = dict(state)
        change(s)
        save_file(s, str(bad / "model.safetensors"))
        with pytest.raises(VlaforgeError) as err:
            load_policy(bad, over)
        msg = str(err.value)
        assert "\n" not in msg
        assert {"missing": "action_head.action_in_proj.weight", "extra": "model.surprise.weight",
                "shape": "(3, 3)"}[case] in msg, msg


@pytest.mark.parametrize("override, fragment", [
    ("--components.llm.checkpointing=selective", "components.llm.checkpointing = 'selective' is not built for "
                                                 "LeRobot policies: their unit is the joint layer"),
    ("--components.action_head.checkpointing=full", "a LeRobot policy's expert blocks run inside the joint layers"),
    ("--components.action_head.precision=bf16", "run the VLM's and the expert's blocks in one attention"),
    ("--components.llm.precision=fp8", "precision = 'fp8' is not built for LeRobot policies"),
    ("--parallel.tp=2", "parallel.tp > 1 is not built for LeRobot policies"),
    ("--loss.weights.language=0.5", "loss.weights.language is not built for LeRobot policies"),
])
def test_unbuilt_techniques_refused(session_root, override, fragment):
    from conftest import run_cli

    folder, _ = _folder("smolvla", session_root)
    done = run_cli("train", "recipes/smolvla.toml", f"--model.lerobot.pretrained={folder}", "--data.path=x", override,
                   timeout=120)
    assert done.returncode == 2, done.stderr[-1500:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], done.stderr


def test_folder_refusals_through_the_cli(session_root, tmp_path):
    """A missing processor file, a hub id as SmolVLA's VLM (`vlaforge serve DIR`), a package export or quantization of a
    policy (not built yet): exit 2 with one line each."""
    import shutil

    from conftest import run_cli

    folder, _ = _folder("smolvla", session_root)
    no_pre = tmp_path / "no_pre"
    shutil.copytree(folder, no_pre)
    (no_pre / "policy_preprocessor.json").unlink()
    hub = tmp_path / "hub"
    shutil.copytree(folder, hub)
    cfg = json.loads((hub / "config.json").read_text())
    hub_id = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
    (hub / "config.json").write_text(json.dumps({**cfg, "vlm_model_name": hub_id}))
    cases = [(("serve", no_pre, "--port=0"), "policy_preprocessor.json"),
             (("serve", hub, "--port=0"), "model.lerobot.vlm"),
             (("export", folder, "--format=onnx", f"--out={tmp_path / 'pkg'}"), "export --format onnx of a LeRobot"),
             (("quantize", folder, f"--out={tmp_path / 'q'}"), "quantize of a LeRobot policy")]
    for (verb, path, *rest), fragment in cases:
        done = run_cli(verb, str(path), *rest, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and fragment in lines[0], done.stderr[-1500:]


def test_the_cli_takes_a_folders_lerobot_settings(session_root):
    """`vlaforge serve DIR --lerobot-sizes FILE` serves a pi0 folder of other sizes than LeRobot's variants (a client
    gets its chunk); a --lerobot-* option for something that is not a LeRobot folder is refused in one line."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from vlaforge.inference.runtime import Observation
    from vlaforge.serving.client import wire_observation

    from conftest import run_cli, served

    folder, options = _folder("pi0", session_root)
    obs = Observation({c: np.zeros((24, 32, 3), np.uint8) for c in ("top", "wrist")}, np.zeros(6, np.float32),
                      "pick up the cube")
    with served(folder, f"--lerobot-sizes={options['sizes']}") as uri:
        host, port = uri.removeprefix("ws://").split(":")
        reply = WebsocketClientPolicy(host, int(port)).infer(wire_observation(obs))
    assert np.asarray(reply["actions"]).shape == (5, 6)
    done = run_cli("serve", "recipes", "--lerobot-sizes=x.json", "--port=0", timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "--lerobot-sizes applies to a LeRobot policy" in lines[0]


def test_a_fine_tune_resumes_bit_exactly(session_root, tmp_path):
    """A SmolVLA fine-tune of 4 steps equals 2 steps, then a resume for 2 more, to the bit: the flow-matching noise and
    times come from the restored RNG state, the data order from the resumable sampler."""
    import shutil

    from safetensors.torch import load_file

    from conftest import run_cli
    from fake_lerobot import write_dataset

    folder, _ = _folder("smolvla", session_root)
    write_dataset(tmp_path / "ds")
    common = ["train", "recipes/smolvla.toml", f"--model.lerobot.pretrained={folder}", f"--data.path={tmp_path / 'ds'}",
              "--train.batch_size=4", "--train.warmup_steps=0", "--train.progress=false", "--train.tensorboard=false",
              "--components.llm.trainable=true", "--train.steps=4", "--train.checkpoint_every=2"]
    for name, extra in (("straight", []), ("resumed", []), ("resumed", ["--train.resume=latest"])):
        if extra:  # back to step 2: the second half again, from the checkpoint
            shutil.rmtree(tmp_path / name / "checkpoints" / "step_00000004")
            (tmp_path / name / "checkpoints" / "latest").write_text("step_00000002")
        done = run_cli(*common, f"--train.output_dir={tmp_path / name}", *extra, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    a, b = (load_file(str(tmp_path / n / "checkpoints" / "step_00000004" / "model.safetensors"))
            for n in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start = load_file(str(folder / "model.safetensors"))
    assert not torch.equal(a["action_head.action_in_proj.weight"], start["model.action_in_proj.weight"])  # it trained
