"""The switch from LeRobot costs one word: `lerobot-train` -> `vlaforge lerobot-train` (src/vlaforge/lerobot_train.py)
with the fine-tune command lines of LeRobot 0.6.1's own documentation for SmolVLA, pi0 and pi0.5, unchanged, on
folders LeRobot itself wrote, named by their Hub ids in an offline Hugging Face cache (tests/hub_cache.py) - the
policies, SmolVLA's VLM and PaliGemma's tokenizer that the folders themselves name - and datasets in HF_LEROBOT_HOME.
LeRobot 0.6.1 loads what the runs write (OUT/checkpoints/last/pretrained_model) strictly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lerobot061 as ref061
import numpy as np
import pytest
import torch
from hub_cache import cache_repo

from vlaforge.errors import VlaforgeError

from conftest import run_cli

pytestmark = pytest.mark.xdist_group("lerobot061")

VLM_ID = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
TOKENIZER_ID = "google/paligemma-3b-pt-224"
# LeRobot 0.6.1's docs/source/smolvla.mdx, pi0.mdx and pi05.mdx (the first fine-tune command of each), as written
# (${HF_USER}: the shell's expansion, as a user's shell does it)
SMOLVLA_DOCS = ["--policy.path=lerobot/smolvla_base", "--dataset.repo_id=testuser/mydataset", "--batch_size=64",
                "--steps=20000", "--output_dir=outputs/train/my_smolvla", "--job_name=my_smolvla_training",
                "--policy.device=cuda", "--wandb.enable=true"]
PI0_DOCS = ["--dataset.repo_id=your_dataset", "--policy.type=pi0", "--output_dir=./outputs/pi0_training",
            "--job_name=pi0_training", "--policy.pretrained_path=lerobot/pi0_base", "--policy.repo_id=your_repo_id",
            "--policy.compile_model=true", "--policy.gradient_checkpointing=true", "--policy.dtype=bfloat16",
            "--policy.freeze_vision_encoder=false", "--policy.train_expert_only=false", "--steps=3000",
            "--policy.device=cuda", "--batch_size=32"]
PI05_DOCS = ["--dataset.repo_id=lerobot/libero", "--policy.type=pi05",
             "--policy.pretrained_path=lerobot/pi05_libero_base",
             '--policy.normalization_mapping={"ACTION": "MEAN_STD", "STATE": "MEAN_STD", "VISUAL": "IDENTITY"}',
             "--policy.n_action_steps=10", "--policy.empty_cameras=1", "--policy.freeze_vision_encoder=false",
             "--policy.train_expert_only=false", "--policy.gradient_checkpointing=true", "--policy.dtype=bfloat16",
             "--policy.device=cuda", "--policy.push_to_hub=false", "--output_dir=./outputs/pi05_libero",
             "--job_name=pi05_libero", "--batch_size=64", "--num_workers=8", "--steps=30000", "--save_freq=5000",
             "--seed=1000"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict:
    """An offline Hugging Face cache and LeRobot home holding what the documented command lines name: the tiny
    SmolVLA folder as lerobot/smolvla_base (its config.json naming SmolVLM2 by its Hub id, which is cached too) and
    one small dataset under each documented id; `pi_folders` adds pi0's and pi0.5's."""
    from fake_lerobot import write_dataset

    root = ref061.session_root(tmp_path_factory)
    base = tmp_path_factory.mktemp("hub")
    cache, home = base / "hub", base / "lerobot"
    smolvla = ref061.policy_folder("smolvla", root)
    copy = base / "smolvla_base"
    shutil.copytree(smolvla / "policy", copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "vlm_model_name": VLM_ID}))
    cache_repo(cache, "lerobot/smolvla_base", copy)
    cache_repo(cache, VLM_ID, smolvla / "vlm", skip=("model.safetensors",))  # config and tokenizer: LeRobot's use
    for repo in ("testuser/mydataset", "your_dataset", "lerobot/libero"):
        write_dataset(home / repo, cams=["image", "wrist_image"], text=False, env_state=False)
    return {"cache": cache, "home": home, "sizes": {}, "root": root}


@pytest.fixture(scope="module")
def pi_folders(hub) -> dict:
    """The tiny pi0 / pi0.5 folders at LeRobot's defaults as lerobot/pi0_base and lerobot/pi05_libero_base, their
    pipelines naming PaliGemma's tokenizer by its Hub id (cached)."""
    for kind, repo in (("pi0_base", "lerobot/pi0_base"), ("pi05_base", "lerobot/pi05_libero_base")):
        out = ref061.policy_folder(kind, hub["root"])
        cache_repo(hub["cache"], repo, out / "policy")
        cache_repo(hub["cache"], TOKENIZER_ID, out / "tokenizer")
        hub["sizes"][repo] = out / "sizes.json"
    return hub


@pytest.fixture()
def offline(hub, monkeypatch):
    from vlaforge import hub as resolver

    monkeypatch.setenv("HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setenv("HF_LEROBOT_HOME", str(hub["home"]))
    # NOTE: the ids this test resolves in-process are remembered (`hub.RESOLVED`) and forked CLI runs inherit them:
    # kept from later tests, which expect an id outside this cache to be refused (test_lerobot_policies.py's
    # `serve` of a folder naming SmolVLM2 by its id hung, serving, when it ran after this file)
    monkeypatch.setattr(resolver, "RESOLVED", {})
    return hub


def _overrides(argv: list[str]) -> dict[str, str]:
    from vlaforge.lerobot_train import translate

    t = translate(argv)
    return t, {o.split("=", 1)[0][2:]: o.split("=", 1)[1] for o in t.overrides}


def test_the_smolvla_docs_command_becomes_a_vlaforge_run_with_lerobots_semantics(offline):
    """SmolVLA's documented command: its policy preset (lr 1e-4, betas, weight decay on every parameter, LeRobot's
    cosine decay with its warmup and decay steps), train_expert_only's frozen VLM, batch_size samples per step,
    LeRobot's seed 1000, cuda falling back to the CPU, wandb's logs as TensorBoard's."""
    t, o = _overrides(SMOLVLA_DOCS)
    assert t.recipe.endswith("recipes/smolvla.toml") and o["model.lerobot.pretrained"] == '"lerobot/smolvla_base"'
    assert o["data.path"] == '"testuser/mydataset"' and o["train.batch_size"] == "64" and o["train.grad_accum"] == "1"
    assert o["train.steps"] == "20000" and o["train.seed"] == "1000" and o["train.output_dir"] == \
        '"outputs/train/my_smolvla"'
    assert o["components.action_head.lr"] == "0.0001" and o["train.lr_schedule"] == '"cosine_decay_with_warmup"'
    assert o["train.decay_steps"] == "30000" and o["train.warmup_steps"] == "1000" and o["train.decay_all"] == "true"
    assert float(o["train.min_lr_ratio"]) == pytest.approx(2.5e-6 / 1e-4)
    # the folder's own config rules with --policy.path (the tiny folder was saved with train_expert_only = false)
    assert o["components.llm.trainable"] == o["components.vision.trainable"] == "true"
    _, frozen = _overrides([*SMOLVLA_DOCS, "--policy.train_expert_only=true"])
    assert frozen["components.llm.trainable"] == frozen["components.vision.trainable"] == "false"
    assert frozen["model.lerobot.config"].startswith("{") and '"train_expert_only" = true' in \
        frozen["model.lerobot.config"]
    assert o["train.device"] == ('"cuda"' if torch.cuda.is_available() else '"cpu"')
    assert any("wandb" in n for n in t.notes) and o["lerobot.layout"] == "true"
    assert t.command().startswith("vlaforge train ")


def test_pi0_with_type_takes_lerobots_defaults_and_the_flags(offline, pi_folders):
    """--policy.type builds the config from pi0's defaults (only the weights come from the folder): its preset, with
    the flags' bf16 compute, checkpointed joint layers, compile and the repo to push to."""
    t, o = _overrides(PI0_DOCS)
    assert o["components.llm.precision"] == '"bf16"' and o["components.llm.checkpointing"] == '"full"'
    assert o["train.compile"] == "true" and o["lerobot.repo_id"] == '"your_repo_id"'
    assert o["components.llm.lr"] == "2.5e-05" and o["components.vision.trainable"] == "true"
    assert o["data.path"] == '"your_dataset"'
    from vlaforge.lerobot_train import translate

    with pytest.raises(VlaforgeError, match="absolute actions"):
        translate([*PI0_DOCS, "--policy.use_relative_actions=true"])


@pytest.mark.parametrize("argv, says", [
    (["--policy.path=lerobot/smolvla_base", "--policy.type=smolvla", "--dataset.repo_id=a/b"], "conflicts with it"),
    (["--dataset.repo_id=a/b"], "no policy to fine-tune"),
    (["--policy.type=pi0", "--dataset.repo_id=a/b"], "no policy to fine-tune"),
    (["--policy.path=lerobot/smolvla_base"], "--dataset.repo_id is required"),
    (["--policy.path=lerobot/smolvla_base", "--dataset.repo_id=a/b", "--batch_size=abc"], "--batch_size takes an "
                                                                                          "integer, not 'abc'"),
    (["--policy.path=lerobot/smolvla_base", "--dataset.repo_id=a/b", "--bogus=1"], "--bogus is not a lerobot-train "
                                                                                   "flag"),
    (["--policy.path=lerobot/smolvla_base", "--dataset.repo_id=a/b", "--policy.bogus=1"], "bogus is not a field of "
                                                                                          "a smolvla"),
    (["--policy.path=lerobot/smolvla_base", "--dataset.repo_id=a/b", "--env.type=libero"], "simulator evaluation"),
    (["--policy.path=lerobot/smolvla_base", "--dataset.repo_id=a/b", "--save_checkpoint=false"], "always writes"),
    (["--policy.path=lerobot/smolvla_base", "--dataset.repo_id=a/b", "--seed=null"], "vlaforge seeds every run"),
    (["--policy.path=lerobot/smolvla_base", "--dataset.repo_id=a/b", "--steps=1", "--steps=2"], "given twice"),
    (["--policy.path=lerobot/smolvla_base", "--dataset.repo_id=a/b", "--optimizer.lr=1"], "--policy.optimizer_lr"),
    (["--policy.path=lerobot/smolvla_base", "--dataset.repo_id=a/b", "--policy.use_amp=maybe"], "true or false"),
    (["--resume=true"], "needs --config_path"),
    (["--policy.path=nobody/nothing", "--dataset.repo_id=a/b"], "hf download nobody/nothing"),
    (["--policy.type=pi05", "--policy.pretrained_path=lerobot/smolvla_base", "--dataset.repo_id=a/b"],
     "holds a smolvla policy"),
])
def test_refusals_name_the_flag_and_the_fix(argv, says, offline):
    from vlaforge.lerobot_train import translate

    with pytest.raises(VlaforgeError) as err:
        translate(argv)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def _tiny(argv: list[str], out: Path, *extra: str) -> list[str]:
    """A documented command at test size: its output_dir in `out`, then vlaforge's own flags (last: they apply after
    LeRobot's) for 2 steps of 2 samples."""
    argv = [a for a in argv if not a.startswith("--output_dir=")] + [f"--output_dir={out}"]
    return ["lerobot-train", *argv, "--train.steps=2", "--train.batch_size=2", "--train.progress=false",
            "--train.tensorboard=false", "--data.num_workers=0", *extra]


def _lerobot_loads(folder: Path, sizes: Path | None, tmp: Path) -> dict:
    """LeRobot 0.6.1's strict load of a pretrained_model folder (every key found, each value the file's) and, for
    an fp32 folder, its outputs on the standard inputs (a bfloat16 one loads cast to bf16: the load check only)."""
    from safetensors.torch import load_file, save_file

    if sizes is not None:
        shutil.copy(sizes, folder.parent / "sizes.json")  # where LeRobot's side reads the tiny sizes
    inputs, tasks = ref061.sample_inputs()
    cams = json.loads((folder / "config.json").read_text())["input_features"]
    images = [k for k, v in cams.items() if v["type"] == "VISUAL" and "empty_camera" not in k]
    inputs = {**{k: inputs[c] for k, c in zip(images, ref061.CAMERAS)}, "observation.state": inputs[
        "observation.state"][:, :4], "action": inputs["action"][..., :4]}
    chunk, pad = (json.loads((folder / "config.json").read_text())[k] for k in ("chunk_size", "max_action_dim"))
    inputs["noise"] = torch.randn(2, chunk, pad, generator=torch.Generator().manual_seed(1))
    inputs["action"] = torch.randn(2, chunk, 4, generator=torch.Generator().manual_seed(2))
    inputs["time"] = torch.tensor([0.3, 0.7])
    given = tmp / "inputs.safetensors"
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(given), metadata={"tasks": json.dumps(tasks)})
    fp32 = json.loads((folder / "config.json").read_text()).get("dtype", "float32") == "float32"
    out = tmp / "lerobot.safetensors" if fp32 else "-"
    check = json.loads(ref061.run("export_check.py", str(folder), str(given), str(out)).strip().splitlines()[-1])
    assert check["missing"] == check["unexpected"] == check["differ"] == [], check
    return {"inputs": inputs, "tasks": tasks, "out": load_file(str(out)) if fp32 else None}


def test_the_smolvla_docs_command_trains_and_lerobot_loads_its_checkpoint(offline, tmp_path):
    """`vlaforge lerobot-train` + SmolVLA's documented command: LeRobot's layout (checkpoints/<step>/pretrained_model,
    last), which LeRobot 0.6.1 loads strictly and which predicts LeRobot's actions in vlaforge's runtime; the command
    it became and the ids' commits are kept in the run; --resume=true continues it."""
    from vlaforge.inference.runtime import Observation, PolicyRuntime

    out = tmp_path / "run"
    done = run_cli(*_tiny(SMOLVLA_DOCS, out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lerobot-train -> vlaforge train" in done.stderr and "lerobot-eval --policy.path=" in done.stdout
    last = out / "checkpoints" / "last"
    assert last.is_symlink() and str(last.readlink()) == "000002"
    pretrained = last / "pretrained_model"
    assert json.loads((pretrained / "train_config.json").read_text())["lerobot_train"][0].startswith("--policy.path")
    sources = {s["ref"]: s for s in json.loads((out / "sources.json").read_text())}
    assert {"lerobot/smolvla_base", VLM_ID, "testuser/mydataset"} <= sources.keys()
    assert sources["lerobot/smolvla_base"]["commit"] and sources[VLM_ID]["commit"]
    theirs = _lerobot_loads(pretrained, None, tmp_path)
    runtime = PolicyRuntime.load(pretrained, device="cpu")
    raw = theirs["inputs"]
    obs = Observation({c: (raw[f"observation.images.{c}"][0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
                       for c in runtime.cameras}, raw["observation.state"][0].numpy(), theirs["tasks"][0])
    assert runtime.predict(obs, noise=raw["noise"][0].numpy()).actions.shape == theirs["out"]["post"][0].shape
    done = run_cli("lerobot-train", "--resume=true", f"--config_path={pretrained / 'train_config.json'}",
                   "--steps=3", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert str((out / "checkpoints" / "last").readlink()) == "000003"


@pytest.mark.parametrize("docs, repo", [(PI0_DOCS, "lerobot/pi0_base"), (PI05_DOCS, "lerobot/pi05_libero_base")])
def test_the_pi0_and_pi05_docs_commands_train_and_lerobot_loads_them(docs, repo, offline, pi_folders, tmp_path):
    """pi0's and pi0.5's documented commands (--policy.type with --policy.pretrained_path: LeRobot's defaults, the
    folder's weights; pi0.5's MEAN_STD mapping, 10 executed actions and an empty camera; bf16, checkpointed, pi0
    compiled): the runs' pretrained_model folders load strictly in LeRobot 0.6.1 with those settings."""
    out = tmp_path / "run"
    # (pi0's --policy.compile_model: compiling bf16 joint layers takes ~45 s on this CPU; compile's exactness is
    # test_lerobot_policy_techniques.py's, the flag's mapping test_pi0_with_type_takes_lerobots_defaults_and_the_flags)
    done = run_cli(*_tiny(docs, out, f"--model.lerobot.sizes={offline['sizes'][repo]}", "--train.compile=false"),
                   timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    pretrained = out / "checkpoints" / "last" / "pretrained_model"
    cfg = json.loads((pretrained / "config.json").read_text())
    if repo.startswith("lerobot/pi05"):
        assert cfg["normalization_mapping"]["STATE"] == "MEAN_STD" and cfg["n_action_steps"] == 10
        assert cfg["empty_cameras"] == 1
    _lerobot_loads(pretrained, offline["sizes"][repo], tmp_path)


def test_serve_and_eval_take_a_policys_hub_id(offline):
    """`vlaforge serve lerobot/smolvla_base` serves the cached policy (its config.json's VLM id resolved from the
    cache too) and a client gets the actions PolicyRuntime gives for the folder itself; `vlaforge eval ID` takes the
    --lerobot-* settings (and says in one line why Meta-World cannot feed this policy's cameras)."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from vlaforge.inference.runtime import Observation, PolicyRuntime
    from vlaforge.serving.client import wire_observation

    from conftest import served

    obs = Observation({c: np.full((24, 32, 3), 100, np.uint8) for c in ("top", "wrist")}, np.zeros(6, np.float32),
                      "pick up the red cube")
    with served("lerobot/smolvla_base") as uri:
        host, port = uri.removeprefix("ws://").split(":")
        reply = WebsocketClientPolicy(host, int(port)).infer(wire_observation(obs))
    assert np.asarray(reply["actions"]).shape == (5, 6)
    runtime = PolicyRuntime.load("lerobot/smolvla_base", device="cpu")
    noise = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
    local = PolicyRuntime.load(ref061.policy_folder("smolvla", offline["root"]) / "policy", device="cpu")
    np.testing.assert_allclose(runtime.predict(obs, noise=noise).actions, local.predict(obs, noise=noise).actions,
                               atol=1e-6)
    done = run_cli("eval", "lerobot/smolvla_base", "--tasks=reach-v3", "--episodes=1", f"--lerobot-vlm={VLM_ID}",
                   "--workers=1", timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "camera" in lines[0], done.stderr[-1500:]
