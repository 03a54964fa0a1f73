"""A policy's `empty_cameras` (LeRobot's pi0.5 LIBERO fine-tune: `--policy.empty_cameras=1`) against LeRobot 0.6.1 on
a tiny pi0.5 its own `save_pretrained` wrote with empty_cameras=1 (kind `pi05_empty`: cameras top and wrist, then
`observation.images.empty_camera_0` in config.json): per-element and scalar losses, every gradient, sampled actions
and raw observation -> action, through each of vlaforge's three input paths (LeRobot's batch, vlaforge's training
`Batch`, a prediction from the cameras' tokens). fp32 on CPU, the tolerances of tests/test_lerobot_policies.py. Also
LeRobot's numbers on the `*_base` folders (LeRobot's default config: chunk 50, pads of 32, 224 px)."""

from __future__ import annotations

import lerobot061 as ref061
import numpy as np
import pytest
import torch

from vlaforge.data.batch import Batch

pytestmark = pytest.mark.xdist_group("lerobot061")

KIND = "pi05_empty"
TOL = 1e-5


@pytest.fixture(scope="module")
def session_root(tmp_path_factory):
    return ref061.session_root(tmp_path_factory)


def _model(out):
    from vlaforge.checkpoints.load import load_policy_model

    model, _, _ = load_policy_model(out / "policy", lerobot=ref061.folder_options(out))
    return model


def _inputs():
    """The standard batch with its images made of uint8 frames, so the runtime (which takes uint8) sees them too."""
    inputs, tasks = ref061.sample_inputs()
    frames = {cam: (inputs[cam] * 255).round().to(torch.uint8) for cam in ref061.CAMERAS}
    inputs.update({cam: f.float() / 255 for cam, f in frames.items()})
    return inputs, tasks, frames


def test_empty_camera_slots_match_lerobot(session_root):
    out = ref061.policy_folder(KIND, session_root)
    inputs, tasks, frames = _inputs()
    theirs, meta = ref061.reference(KIND, session_root, inputs, tasks)
    model = _model(out)
    assert model.spec.cameras == ref061.CAMERAS and model.spec.empty_cameras == 1  # a batch never holds the empty one
    batch = {k[4:]: v for k, v in theirs.items() if k.startswith("pre.")}
    model.train()
    x = model.prepare(batch)
    assert len(x.images) == 3 and not x.image_masks[2].any() and bool((x.images[2] == -1).all())
    _, pad, _ = model.embed_prefix(x)
    per = model.embed_image(x.images[0]).shape[1]
    assert pad.shape[1] == 3 * per + x.tokens.shape[1] and not pad[:, 2 * per:3 * per].any()  # the masked slot
    assert (model.losses(x, inputs["noise"], inputs["time"]) - theirs["losses"]).abs().max() <= TOL
    loss = model.loss(x, inputs["noise"], inputs["time"])
    assert abs(loss.item() - meta["loss"]) <= TOL
    loss.backward()
    count, worst = ref061.worst_grad(model, theirs)
    assert count > 20 and worst <= TOL, (count, worst)
    model.eval()
    sample = model.sample_actions(model.prepare(batch, with_actions=False), inputs["noise"])
    assert (sample - theirs["sample"]).abs().max() <= TOL
    # vlaforge's training Batch: the real cameras only, at the policy's size in [-1, 1]
    train = Batch(images=torch.stack(x.images[:2], dim=1), state=batch["observation.state"],
                  instruction_ids=x.tokens, instruction_mask=x.token_mask, actions=batch["action"],
                  action_mask=torch.ones(batch["action"].shape[:2], dtype=torch.bool))
    with torch.no_grad():
        losses = model.losses(model.inputs_from_batch(train), inputs["noise"], inputs["time"])
    assert (losses - theirs["losses"]).abs().max() <= TOL
    # a prediction from the real cameras' tokens (the runtime's frame-feature cache, exported packages)
    tokens = torch.cat([model.encode_frames(image) for image in x.images[:2]], dim=1)
    given = model.token_inputs(tokens, x.tokens, x.token_mask, batch["observation.state"])
    assert (model.sample_actions(given, inputs["noise"], image_tokens=tokens) - theirs["sample"]).abs().max() <= TOL
    _runtime_matches(out, frames, inputs, tasks, theirs["post"])


def _runtime_matches(out, frames: dict, inputs: dict, tasks: list[str], post: torch.Tensor) -> None:
    """`PolicyRuntime.predict` on sample 0's raw observation (the two real cameras: the runtime asks for no other)
    against LeRobot's postprocessed actions."""
    from vlaforge.inference.runtime import Observation, PolicyRuntime

    runtime = PolicyRuntime.load(out / "policy", device="cpu", lerobot=ref061.folder_options(out))
    assert runtime.cameras == ["top", "wrist"]
    obs = Observation({cam.removeprefix("observation.images."): f[0].permute(1, 2, 0).numpy()
                       for cam, f in frames.items()}, inputs["observation.state"][0].numpy(), tasks[0])
    pred = runtime.predict(obs, noise=inputs["noise"][0].numpy())
    assert np.abs(pred.actions - post[0].numpy()).max() <= 1e-4


def test_the_count_comes_from_config_json_and_its_overrides(session_root):
    """model.lerobot.config.empty_cameras (lerobot-train's --policy.empty_cameras) sets the slots over the folder's;
    a run's own cameras (`fit_shapes`: the dataset's) keep them on top; out of range, or below an empty camera
    config.json names, refused in one line."""
    from types import SimpleNamespace

    from vlaforge.errors import VlaforgeError
    from vlaforge.models.policies.reader import fit_shapes, load_policy, overrides_from

    out = ref061.policy_folder(KIND, session_root)
    over = overrides_from(type("S", (), {"sizes": str(out / "sizes.json"), "vlm": None})())
    model = load_policy(out / "policy", over, fake=True, config={"empty_cameras": 2})
    assert model.spec.cameras == ref061.CAMERAS and model.spec.empty_cameras == 2 and model.layout.frames == 4
    fit_shapes(model, SimpleNamespace(cameras=["image"], state_dim=4, action_dim=4))  # what a run's model config gives
    assert model.spec.cameras == ("observation.images.image",) and model.spec.empty_cameras == 2
    for value, says in ((65, "is not an integer from 0 to 64"), (0, "set empty_cameras to at least 1")):
        with pytest.raises(VlaforgeError) as err:
            load_policy(out / "policy", over, fake=True, config={"empty_cameras": value})
        assert "\n" not in str(err.value) and says in str(err.value) and "model.lerobot.config.empty_cameras" in \
            str(err.value), str(err.value)
