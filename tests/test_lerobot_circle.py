"""The circle with LeRobot 0.6.1 itself (tests/lerobot061.py): a LeRobot-made SmolVLA folder fine-tuned from its recipe
on a generated Meta-World dataset (the loss falls), evaluated in the simulator, exported with `--format lerobot`:
LeRobot's own `from_pretrained` loads the export with no missing or unexpected keys (tests/lerobot_env061/
export_check.py) and gives vlaforge's actions for the same inputs and noise, and the export served over LeRobot's gRPC
answers LeRobot's own robot client with the runtime's actions; LeRobot-made folders exported as they are; refusals in
one line."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import lerobot061 as ref061
import pytest
import torch
from safetensors.torch import load_file, save_file

from vlaforge.checkpoints.lerobot_folder import PIPELINES, REPORT, default_steps, export_lerobot

from conftest import run_cli

pytestmark = pytest.mark.xdist_group("lerobot061")

CAMERAS = ("corner", "behindGripper")  # the generated Meta-World dataset's, rendered at 32 px


@pytest.fixture
def root(tmp_path_factory) -> Path:
    """The session's LeRobot-made folders (tests/lerobot061.py), read only; the circle renames a copy of its own
    (`finetuned`). A function fixture: these tests spread over the workers."""
    return ref061.session_root(tmp_path_factory)


def _own_copy(folder: Path, dst: Path) -> Path:
    """A copy of a session folder (policy, VLM) at `dst`, its files naming the copy's VLM where the session's named
    the session's: what make_policy.py writes there, to move away without touching what other tests read."""
    shutil.copytree(folder, dst, ignore=shutil.ignore_patterns("references", "*.lock"))
    for path in (dst / "policy").glob("*.json"):
        text = path.read_text()
        if str(folder) in text:
            path.write_text(text.replace(str(folder), str(dst)))
    assert str(dst / "vlm") in (dst / "policy" / "config.json").read_text()
    return dst


def _lerobot_on(folder: Path, inputs: dict[str, torch.Tensor], tasks: list[str], tmp: Path
                ) -> tuple[dict, dict[str, torch.Tensor]]:
    """LeRobot's strict-load check of `folder` and (when it passes) reference.py's outputs on it."""
    given, out = tmp / "inputs.safetensors", tmp / "lerobot.safetensors"
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(given), metadata={"tasks": json.dumps(tasks)})
    check = json.loads(ref061.run("export_check.py", str(folder), str(given), str(out)).strip().splitlines()[-1])
    assert check["missing"] == check["unexpected"] == check["differ"] == [], check
    return check, load_file(str(out))


def _bare(steps: list[dict]) -> list[dict]:
    """Pipeline steps without what an export sets (statistics, features, norm_map, the tokenizer's folder)."""
    out = copy.deepcopy(steps)
    for entry in out:
        entry.pop("state_file", None)
        if entry["registry_name"] in ("normalizer_processor", "unnormalizer_processor"):
            entry["config"].update(features={}, norm_map={})
        entry["config"].pop("tokenizer_name", None)
    return out


@pytest.mark.parametrize("kind", ("smolvla", "pi0"))
def test_folder_export_loads_strictly_in_lerobot_with_the_same_actions(kind, root, tmp_path):
    src = ref061.policy_folder(kind, root)
    out = tmp_path / "export" / "policy"
    if kind == "pi0":  # declared tiny sizes: through the Python API (the CLI has no sizes option)
        report = export_lerobot(src / "policy", out, {"sizes": str(src / "sizes.json")})
        shutil.copy(src / "sizes.json", out.parent / "sizes.json")  # where LeRobot's side reads the tiny sizes
        width = json.loads((src / "sizes.json").read_text())["variants"]["gemma_300m"]["width"]
        vocab = json.loads((src / "sizes.json").read_text())["vocab_size"]
        assert [(f["name"], f["shape"]) for f in report["zero_filled"]] == [
            ("model.paligemma_with_expert.gemma_expert.lm_head.weight", [vocab, width])]
        assert report["tied"] == [["model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight",
                                   "model.paligemma_with_expert.paligemma.lm_head.weight"]]
    else:
        done = run_cli("export", str(src / "policy"), "--format=lerobot", f"--out={out}", timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        report = json.loads((out / REPORT).read_text())
        assert report["zero_filled"] == [] and report["tied"] == []
    for name in ("config.json", *PIPELINES):  # a folder's own files, copied
        assert (out / name).read_bytes() == (src / "policy" / name).read_bytes(), name
        if name in PIPELINES:  # and LeRobot's default steps (a run whose folder is gone) are the ones it wrote
            cfg = json.loads((src / "policy" / "config.json").read_text())
            assert _bare(json.loads((out / name).read_text())["steps"]) == _bare(default_steps(cfg)[name])
    inputs, tasks = ref061.sample_inputs()
    theirs, _ = ref061.reference(kind, root, inputs, tasks)
    check, exported = _lerobot_on(out, inputs, tasks, tmp_path)
    assert check["tensors"] == report["tensors"]
    for key in ("post", "sample"):
        assert (exported[key] - theirs[key]).abs().max() <= 1e-6, key


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory) -> dict[str, Path]:
    """The circle's first half: a LeRobot-made SmolVLA folder (this module's copy of the session's: its tests move it
    away) fine-tuned from recipes/smolvla.toml on a generated Meta-World dataset (24 steps), then exported with
    `--format lerobot`."""
    tmp = tmp_path_factory.mktemp("circle")
    session = ref061.policy_folder("smolvla", ref061.session_root(tmp_path_factory))
    src = _own_copy(session, tmp / session.name) / "policy"
    gen = run_cli("data", "generate", "--tasks=reach-v3", "--episodes=2", "--image-size=32", f"--out={tmp / 'ds'}",
                  f"--cameras={','.join(CAMERAS)}", "--workers=1", "--no-progress", "--seed=3", timeout=300)
    assert gen.returncode == 0, gen.stderr[-2000:]
    run = tmp / "run"
    done = run_cli("train", "recipes/smolvla.toml", f"--model.lerobot.pretrained={src}", f"--data.path={tmp / 'ds'}",
                   "--train.steps=24", "--train.batch_size=8", "--train.log_every=1", "--train.warmup_steps=0",
                   "--components.action_head.lr=1e-3", f"--train.output_dir={run}", "--train.progress=false",
                   "--train.tensorboard=false", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp / "export" / "policy"
    done = run_cli("export", str(run), "--format=lerobot", f"--out={out}", timeout=120)
    assert done.returncode == 0 and "wrote" in done.stdout, done.stderr[-2000:]
    return {"src": src, "run": run, "export": out, "tmp": tmp}


@pytest.mark.over_budget("the circle's module fixture: folder, dataset, fine-tune and export (~42 s), then eval")
def test_circle_finetune_loss_falls_and_eval_runs_without_the_folder(finetuned):
    """The loss of the fine-tune falls, and `vlaforge eval` runs its checkpoint in the simulator with the LeRobot
    folder moved away (the checkpoint keeps its config.json and VLM config: self-contained)."""
    import numpy as np

    run, src = finetuned["run"], finetuned["src"]
    losses = [json.loads(line)["loss/action"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "loss/action" in json.loads(line)]
    assert np.mean(losses[-6:]) < 0.8 * np.mean(losses[:6]), losses
    moved = src.parent.with_name(src.parent.name + "_moved")
    src.parent.rename(moved)
    try:
        ev = run_cli("eval", str(run), "--episodes=1", "--max-steps=4", "--workers=1", "--no-progress",
                     f"--out={finetuned['tmp'] / 'eval'}", timeout=300)
    finally:
        moved.rename(src.parent)
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert "reach-v3" in (finetuned["tmp"] / "eval" / "report.json").read_text()


def test_circle_export_loads_in_lerobot_with_the_runs_features_statistics_and_actions(finetuned, tmp_path):
    """The export of the fine-tuned run: LeRobot reads the run's cameras and sizes, normalizes with its statistics,
    tokenizes with its tokenizer and samples vlaforge's actions. Exported again with the source folder gone
    (LeRobot's default steps), into the same --out."""
    from vlaforge.checkpoints.load import load_policy_model
    from vlaforge.data.tokenizer import load_tokenizer
    from vlaforge.data.transforms import ObservationSpec

    run, out, src = finetuned["run"], finetuned["export"], finetuned["src"]
    model, _, ckpt = load_policy_model(run)
    spec = ObservationSpec.load(ckpt)
    state_dim, action_dim = len(spec.state_mean), len(spec.action_mean)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["input_features"] == {**{f"observation.images.{c}": {"type": "VISUAL", "shape": [3, 32, 32]}
                                        for c in CAMERAS},
                                     "observation.state": {"type": "STATE", "shape": [state_dim]}}
    assert cfg["output_features"] == {"action": {"type": "ACTION", "shape": [action_dim]}}

    g = torch.Generator().manual_seed(4)
    inputs = {f"observation.images.{c}": torch.rand(2, 3, 32, 32, generator=g) for c in CAMERAS}
    inputs.update({"observation.state": torch.tensor(spec.state_mean) + torch.randn(2, state_dim, generator=g)
                   * torch.tensor(spec.state_std), "action": torch.randn(2, 5, action_dim, generator=g),
                   "noise": torch.randn(2, 5, 8, generator=g), "time": torch.full((2,), 0.5)})
    tasks = ["reach the goal", "push the button"]
    _, theirs = _lerobot_on(out, inputs, tasks, tmp_path)
    batch = {k[4:]: v for k, v in theirs.items() if k.startswith("pre.")}
    ours = spec.normalize_state(inputs["observation.state"])
    assert ((batch["observation.state"] - ours).abs() / ours.abs().clamp_min(1)).max() <= 1e-5  # LeRobot's eps 1e-8
    tok = load_tokenizer(ckpt, None)
    mask = batch["observation.language.attention_mask"].bool()
    assert [batch["observation.language.tokens"][i][mask[i]].tolist() for i in range(2)] == [tok.ids(t) for t in tasks]
    model.eval()
    sample = model.sample_actions(model.prepare(batch, with_actions=False), inputs["noise"])
    assert (sample - theirs["sample"]).abs().max() <= 1e-4
    assert (spec.denormalize_action(sample[:, :, :action_dim]) - theirs["post"]).abs().max() <= 1e-4

    first = {name: json.loads((out / name).read_text())["steps"] for name in PIPELINES}
    moved = src.with_name("policy_moved")
    src.rename(moved)
    try:
        again = run_cli("export", str(run), "--format=lerobot", f"--out={out}", timeout=120)
    finally:
        moved.rename(src)
    assert again.returncode == 0 and "default smolvla steps" in again.stdout, again.stderr[-2000:]
    assert {name: json.loads((out / name).read_text())["steps"] for name in PIPELINES} == first


@pytest.mark.slow
def test_circle_served_export_answers_lerobots_robot_client(finetuned, tmp_path):
    """The circle's last step: the export served (`--protocol lerobot`) to LeRobot 0.4.4's own robot client asking for
    policy_type smolvla with the run's cameras and sizes: its chunks equal `PolicyRuntime`'s on the export for the same
    observations, torch seeded alike (tests/test_lerobot_policy_serving.py: the client and the seeding)."""
    import numpy as np

    from vlaforge.inference.runtime import Observation, PolicyRuntime

    from test_lerobot_policy_serving import SEED, _live, _run_client

    export, task = finetuned["export"], "reach the goal"
    cfg = json.loads((export / "config.json").read_text())
    state_dim = cfg["input_features"]["observation.state"]["shape"][0]
    action_dim = cfg["output_features"]["action"]["shape"][0]
    g = np.random.default_rng(0)
    frames = {"state": g.normal(size=(2, state_dim)).astype(np.float32),
              **{c: g.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8) for c in CAMERAS}}
    np.savez(tmp_path / "frames.npz", **frames)
    reference = PolicyRuntime.load(export, device="cpu")
    live, address, _ = _live(PolicyRuntime.load(export, device="cpu"))
    job = {"address": address, "policy_type": "smolvla", "path": "lerobot/smolvla", "task": task, "chunk": 5,
           "frames": str(tmp_path / "frames.npz"), "cameras": list(CAMERAS), "action_dim": action_dim}
    try:
        torch.manual_seed(SEED)
        (result,) = _run_client([job], tmp_path)
    finally:
        live.close()
    assert result["started"] and not result["errors"] and len(result["chunks"]) == 2, result
    torch.manual_seed(SEED)
    for i, chunk in enumerate(result["chunks"]):
        obs = Observation({c: frames[c][i] for c in CAMERAS}, frames["state"][i], task)
        np.testing.assert_allclose(np.asarray(chunk["actions"]), reference.predict(obs, f"ref{i}").actions, atol=1e-5)


def test_export_refusals(root, tmp_path):
    """One line each, exit 2, nothing written: an --out holding something else, a vlaforge VLA run (no LeRobot
    policy type), --out over the source, a missing --out, package options, an unknown format; a package export of the
    folder itself (a fine-tuned run exports one: test_lerobot_policy_export.py)."""
    src = ref061.policy_folder("smolvla", root) / "policy"
    before = sorted(p.name for p in src.iterdir())
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    vla = tmp_path / "vla"
    done = run_cli("train", "recipes/tiny_synthetic.toml", "--train.steps=1", "--train.batch_size=2",
                   "--data.num_samples=4", f"--train.output_dir={vla}", "--train.progress=false",
                   "--train.tensorboard=false", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    new = f"--out={tmp_path / 'new'}"
    cases = [((src, f"--out={taken}"), "was not written by `vlaforge export --format lerobot`"),
             ((vla, new), "exporting to LeRobot needs a run fine-tuned from a LeRobot folder"),
             ((src, f"--out={src}"), "would replace the policy it exports"),
             ((src,), "--format lerobot needs --out DIR"),
             ((src, new, "--frames=3"), "--frames apply to --format onnx|executorch"),
             ((src, new, "--format=tflite"), "is not one of safetensors, onnx, executorch, lerobot"),
             ((src, new, "--format=onnx"), "export a run fine-tuned from it")]
    for args, fragment in cases:
        fmt = [] if any(str(a).startswith("--format") for a in args) else ["--format=lerobot"]
        done = run_cli("export", *map(str, args), *fmt, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and fragment in lines[0], (args, done.stderr[-1500:])
    assert [p.name for p in taken.iterdir()] == ["notes.txt"] and (taken / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "new").exists() and sorted(p.name for p in src.iterdir()) == before
